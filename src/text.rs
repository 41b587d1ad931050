//! Printing text a peer chose: metadata values, error texts, reasons.

use std::borrow::Cow;
use std::fmt::Write as _;

/// True for the characters that must not reach a terminal or a log line raw: C0 and C1
/// controls and DEL (cursor moves, `ESC [`, the 8-bit CSI U+009B, CR/LF that forge a line),
/// bidirectional overrides and isolates (U+202A–U+202E, U+2066–U+2069: text shown in another
/// order than it is), directional marks (U+061C, U+200E, U+200F) and the Unicode line and
/// paragraph separators (U+2028, U+2029).
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `text` with every character that could move a terminal's cursor, rewrite what it shows,
/// reorder it or start a new log line written as a Rust escape (`\n`, `\u{1b}`, `\u{202e}`);
/// everything else, non-ASCII letters included, is kept as is. Borrowed when there is
/// nothing to escape.
///
/// Use it wherever a string a peer controls is printed or logged: a metadata value, an error
/// reply's text, the reason of a peer's `ERROR` frame. The library's own errors already pass
/// peer text through it.
///
/// ```
/// use hyperframes::escape_untrusted;
///
/// assert_eq!(escape_untrusted("cam0"), "cam0");
/// assert_eq!(escape_untrusted("ok\r\n\u{1b}[32mFAKE"), "ok\\r\\n\\u{1b}[32mFAKE");
/// assert_eq!(escape_untrusted("a\u{202e}b"), "a\\u{202e}b");
/// assert_eq!(escape_untrusted("相机"), "相机");
/// ```
pub fn escape_untrusted(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_unsafe(c) {
            let _ = write!(out, "{}", c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_and_direction_character_is_escaped() {
        for c in (0u32..0x20)
            .chain(0x7f..0xa0)
            .chain([0x61c, 0x200e, 0x200f, 0x2028, 0x2029])
            .chain(0x202a..=0x202e)
            .chain(0x2066..=0x2069)
            .filter_map(char::from_u32)
        {
            let s = format!("x{c}y");
            let e = escape_untrusted(&s);
            assert!(!e.contains(c), "{:?} kept raw", c);
            assert!(
                e.starts_with('x') && e.ends_with('y') && e.contains('\\'),
                "{e:#}"
            );
        }
        for s in ["plain", "naïve café", "相机 0", "a\"b'c\\d", "tab-free"] {
            assert!(matches!(escape_untrusted(s), Cow::Borrowed(_)), "{s}");
        }
    }
}
