//! Byte sizes on the command line: `64`, `4k`, `4KiB`, `1MB`, …

/// What the size suffixes mean, for `--help`.
pub(crate) const SIZE_HELP: &str = "A number of bytes with an optional suffix, case-insensitive: \
k, Ki, KiB = 1024; M, Mi, MiB = 1024^2; G, Gi, GiB = 1024^3 (binary); \
kB = 1000, MB = 1000^2, GB = 1000^3 (decimal); B = 1. Examples: 0, 64, 4k, 4KiB, 1MB.";

/// Parses a size such as `64`, `4k`, `4KiB` or `1MB` (whole numbers only: no `1.5M`).
/// `k`/`M`/`G` alone and the `i`/`iB` forms are binary (1024-based); `kB`/`MB`/`GB`
/// are decimal (1000-based). Case-insensitive; spaces around the unit are allowed.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "{text:?} is not a size (expected a whole number of bytes with an optional \
             unit, such as 64, 4k, 4KiB or 1MB)"
        ));
    }
    let (number, unit) = s.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    let unit = unit.trim();
    let factor: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use k, KiB, M, MiB, G, GiB = 1024-based, \
                 or kB, MB, GB = 1000-based)"
            ));
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `n` bytes for people: `1024 bytes` → `1 KiB` only when exact, else plain bytes.
pub(crate) fn human_bytes(n: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{} {unit}", n >> shift);
        }
    }
    if n == 1 {
        "1 byte".to_owned()
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, n) in [
            ("0", 0),
            ("64", 64),
            ("64B", 64),
            ("4k", 4096),
            ("4K", 4096),
            ("4KiB", 4096),
            ("4 kib", 4096),
            ("4kB", 4000),
            ("1M", 1 << 20),
            ("1MiB", 1 << 20),
            ("1Mi", 1 << 20),
            ("1MB", 1_000_000),
            ("2G", 2 << 30),
            ("2GB", 2_000_000_000),
            (" 7 ", 7),
        ] {
            assert_eq!(parse_size(text), Ok(n), "{text}");
        }
        for bad in [
            "",
            "k",
            "-1",
            "1.5M",
            "4X",
            "4KiBs",
            "99999999999999999999",
            "17179869184G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(0), "0 bytes");
        assert_eq!(human_bytes(1), "1 byte");
        assert_eq!(human_bytes(1024), "1 KiB");
        assert_eq!(human_bytes(1025), "1025 bytes");
        assert_eq!(human_bytes(4 << 20), "4 MiB");
    }
}
