//! memlock: how much memory this process may pin (RDMA registration, io_uring buffers).

use super::{Finding, Status};
use crate::units::human_bytes;

/// Soft and hard `Max locked memory` from `/proc/self/limits`; `None` is unlimited.
fn parse_memlock(limits: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let mut fields = line["Max locked memory".len()..].split_whitespace();
    let value = |f: Option<&str>| match f? {
        "unlimited" => Some(None),
        n => n.parse().ok().map(Some),
    };
    Some((value(fields.next())?, value(fields.next())?))
}

/// Whether `CapEff` in `/proc/self/status` holds CAP_IPC_LOCK (bit 14), which lifts the
/// limit for memory registration as for `mlock`.
pub(super) fn has_ipc_lock(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

pub(super) fn check_memlock(limits: Option<&str>, status: Option<&str>) -> Finding {
    const CHECK: &str = "memlock";
    let Some((soft, hard)) = limits.and_then(parse_memlock) else {
        return Finding::new(
            CHECK,
            Status::Error,
            "cannot read `Max locked memory` from /proc/self/limits",
        );
    };
    let show = |l: Option<u64>| l.map_or_else(|| "unlimited".to_owned(), human_bytes);
    let Some(soft_bytes) = soft else {
        return Finding::new(
            CHECK,
            Status::Ok,
            "unlimited: RDMA can register (pin) as much memory as it needs",
        );
    };
    let found = format!(
        "max locked memory {} (hard limit {}): RDMA registers (pins) every buffer it \
         sends from or receives into, and registration fails beyond this",
        show(Some(soft_bytes)),
        show(hard)
    );
    let lines = "  * soft memlock unlimited\n  * hard memlock unlimited\n\
                 systemd service: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1";
    let fix = if hard.is_none() {
        format!(
            "ulimit -l unlimited    (this shell)\n\
             for every login, add to /etc/security/limits.conf:\n{lines}"
        )
    } else {
        format!(
            "add to /etc/security/limits.conf and log in again (the hard limit stops \
             `ulimit -l unlimited` until then):\n{lines}"
        )
    };
    if status.is_some_and(has_ipc_lock) {
        Finding::new(
            CHECK,
            Status::Info,
            format!(
                "{found}; this process has CAP_IPC_LOCK, which lifts the limit, but users \
                 without it are held to it"
            ),
        )
        .fix(fix)
    } else {
        Finding::new(CHECK, Status::Warn, found).fix(fix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::assert_has;

    #[test]
    fn memlock_limits() {
        let limits = |soft: &str, hard: &str| {
            format!(
                "Limit                     Soft Limit           Hard Limit           Units     \n\
                 Max stack size            8388608              unlimited            bytes     \n\
                 Max locked memory         {soft:<20} {hard:<20} bytes     \n"
            )
        };
        let no_caps = "Name:\thf\nCapEff:\t0000000000000000\n";
        let f = check_memlock(Some(&limits("65536", "65536")), Some(no_caps));
        assert_has(
            &f,
            Status::Warn,
            &["max locked memory 64 KiB (hard limit 64 KiB)"],
            &[
                "/etc/security/limits.conf",
                "* hard memlock unlimited",
                "LimitMEMLOCK=infinity",
            ],
        );
        let f = check_memlock(Some(&limits("65536", "unlimited")), Some(no_caps));
        assert_has(
            &f,
            Status::Warn,
            &["64 KiB (hard limit unlimited)"],
            &["ulimit -l unlimited"],
        );
        let f = check_memlock(Some(&limits("unlimited", "unlimited")), Some(no_caps));
        assert_has(&f, Status::Ok, &["unlimited"], &[]);
        assert_eq!(f.fix, None);
        // root's CAP_IPC_LOCK lifts the limit for this process only.
        let root = "CapEff:\t000001ffffffffff\n";
        let f = check_memlock(Some(&limits("8388608", "8388608")), Some(root));
        assert_has(
            &f,
            Status::Info,
            &["8 MiB", "CAP_IPC_LOCK"],
            &["memlock unlimited"],
        );
        for odd in [
            "",
            "Max locked memory",
            "Max locked memory lots lots bytes",
            "\u{0}\u{1}",
        ] {
            let f = check_memlock(Some(odd), Some("CapEff:\tzz"));
            assert_eq!(f.status, Status::Error, "{odd:?}: {f:#?}");
        }
        assert_eq!(check_memlock(None, None).status, Status::Error);
    }
}
