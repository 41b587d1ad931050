//! Patterns on dotted message types: `video.frame`, `ml.splitter.*`, `ml.**`.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};
use crate::message::MsgType;

/// A pattern on message types, matched segment by segment.
///
/// A pattern is dotted like a type; each segment is one of
///
/// | segment | matches |
/// |---|---|
/// | a name (`splitter`) | that segment exactly |
/// | `*` | exactly one segment, whatever it is |
/// | `**` (last segment only) | one or more segments: the rest of the type |
///
/// So `ml.splitter.*` matches `ml.splitter.output` but neither `ml.splitter` nor
/// `ml.splitter.output.shard3`; `ml.**` matches `ml.splitter` and `ml.splitter.output.shard3`
/// but not `ml`; `*.frame` matches `video.frame`; `**` alone matches every type. A pattern
/// without wildcards matches that one type. Wildcards stand for whole segments: `ml*` or
/// `ml.split*` are errors, not prefixes.
///
/// ```
/// use hyperframes::middleware::TypePattern;
///
/// let p: TypePattern = "ml.splitter.*".parse()?;
/// assert!(p.matches_str("ml.splitter.output"));
/// assert!(!p.matches_str("ml.splitter"));
/// assert!(!p.matches_str("ml.splitter.output.shard3"));
/// assert!(TypePattern::new("ml.**")?.matches_str("ml.splitter.output.shard3"));
/// assert!(TypePattern::new("ml.split*").is_err());
/// # Ok::<(), hyperframes::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TypePattern {
    text: Box<str>,
    /// `None` for a pattern without wildcards (compared as a whole string).
    segments: Option<Box<[Segment]>>,
}

/// Byte equality for the short strings of types and keys, kept inline (a `memcmp` call
/// costs more than the comparison): up to 16 bytes it is two loads per side, overlapping
/// when the length is not a power of two, and no loop.
#[inline]
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let n = a.len();
    let w4 = |s: &[u8], at: usize| u32::from_ne_bytes(s[at..at + 4].try_into().expect("4 bytes"));
    let w8 = |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    match n {
        0 => true,
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        8..=16 => w8(a, 0) == w8(b, 0) && w8(a, n - 8) == w8(b, n - 8),
        _ => (0..n - 8).step_by(8).all(|at| w8(a, at) == w8(b, at)) && w8(a, n - 8) == w8(b, n - 8),
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Segment {
    Name(Box<str>),
    One,
    Rest,
}

fn bad(pattern: &str, why: impl fmt::Display) -> Error {
    Error::new(
        ErrorKind::Config,
        format!("type pattern {pattern:?}: {why}"),
    )
}

impl TypePattern {
    /// Parses a pattern; fails with [`ErrorKind::Config`] saying what is wrong with it.
    pub fn new(pattern: &str) -> Result<TypePattern> {
        if pattern.is_empty() {
            return Err(bad(pattern, "is empty"));
        }
        if pattern.len() > MsgType::MAX_LEN {
            return Err(bad(
                pattern,
                format_args!(
                    "is longer than the {} bytes a type may have",
                    MsgType::MAX_LEN
                ),
            ));
        }
        let count = pattern.split('.').count();
        let mut segments = Vec::with_capacity(count);
        let mut wild = false;
        for (i, seg) in pattern.split('.').enumerate() {
            match seg {
                "" => {
                    return Err(bad(
                        pattern,
                        "has an empty segment (two dots, or a dot at an end)",
                    ));
                }
                "*" => {
                    wild = true;
                    segments.push(Segment::One);
                }
                "**" if i + 1 == count => {
                    wild = true;
                    segments.push(Segment::Rest);
                }
                "**" => {
                    return Err(bad(pattern, "`**` may only be the last segment"));
                }
                s if s.contains('*') => {
                    return Err(bad(
                        pattern,
                        format_args!(
                            "segment {s:?}: `*` stands for a whole segment; partial wildcards are not supported"
                        ),
                    ));
                }
                s => {
                    if let Some(b) = s
                        .bytes()
                        .find(|b| !(b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-'))
                    {
                        return Err(bad(
                            pattern,
                            format_args!(
                                "segment {s:?} has {:?}; segments are A-Z a-z 0-9 _ - or a wildcard",
                                b as char
                            ),
                        ));
                    }
                    segments.push(Segment::Name(s.into()));
                }
            }
        }
        Ok(TypePattern {
            text: pattern.into(),
            segments: wild.then(|| segments.into_boxed_slice()),
        })
    }

    /// True when `kind` matches.
    #[inline]
    pub fn matches(&self, kind: &MsgType) -> bool {
        self.matches_str(kind.as_str())
    }

    /// True when the type named `kind` matches (no validation of `kind`).
    pub fn matches_str(&self, kind: &str) -> bool {
        let k = kind.as_bytes();
        let Some(segments) = &self.segments else {
            return same(self.text.as_bytes(), k);
        };
        // `at` is where the next segment of `kind` starts; `k.len() + 1` once all are taken.
        // Byte loops, not `str::split`: types are short, and this runs for every message.
        let mut at = 0;
        for seg in segments.iter() {
            if at > k.len() {
                return false; // the pattern has more segments than the type
            }
            match seg {
                Segment::Rest => return true,
                Segment::One => {
                    at += k[at..]
                        .iter()
                        .position(|&b| b == b'.')
                        .unwrap_or(k.len() - at)
                        + 1;
                }
                Segment::Name(name) => {
                    let name = name.as_bytes();
                    let end = at + name.len();
                    if end > k.len()
                        || !same(&k[at..end], name)
                        || (end < k.len() && k[end] != b'.')
                    {
                        return false;
                    }
                    at = end + 1;
                }
            }
        }
        at == k.len() + 1
    }

    /// True when the pattern has no wildcard and so matches one type only.
    pub fn is_exact(&self) -> bool {
        self.segments.is_none()
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for TypePattern {
    type Err = Error;

    fn from_str(s: &str) -> Result<TypePattern> {
        TypePattern::new(s)
    }
}

impl fmt::Display for TypePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for TypePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TypePattern({:?})", &*self.text)
    }
}

/// Several patterns, any of which may match; shown as `[a.b, c.*]` in logs and errors.
#[derive(Clone, Debug)]
pub(crate) struct PatternSet {
    patterns: Box<[TypePattern]>,
    shown: Box<str>,
}

impl PatternSet {
    /// At least one pattern; each one parsed.
    pub(crate) fn new<I>(patterns: I) -> Result<PatternSet>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let patterns = patterns
            .into_iter()
            .map(|p| TypePattern::new(p.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        if patterns.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                "a type filter needs at least one pattern (`**` matches every type)",
            ));
        }
        let shown = format!(
            "[{}]",
            patterns
                .iter()
                .map(TypePattern::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(PatternSet {
            patterns: patterns.into_boxed_slice(),
            shown: shown.into(),
        })
    }

    #[inline]
    pub(crate) fn matches(&self, kind: &MsgType) -> bool {
        let kind = kind.as_str();
        self.patterns.iter().any(|p| p.matches_str(kind))
    }

    pub(crate) fn patterns(&self) -> &[TypePattern] {
        &self.patterns
    }

    /// `[a.b, c.*]`
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, t: &str) -> bool {
        TypePattern::new(p).unwrap().matches_str(t)
    }

    #[test]
    fn exact_names() {
        assert!(m("video.frame", "video.frame"));
        assert!(!m("video.frame", "video.frames"));
        assert!(!m("video.frame", "video.frame.x"));
        assert!(!m("video_frame", "audio_frame"));
        assert!(TypePattern::new("video.frame").unwrap().is_exact());
    }

    #[test]
    fn star_is_one_segment() {
        assert!(m("ml.splitter.*", "ml.splitter.output"));
        assert!(!m("ml.splitter.*", "ml.splitter"));
        assert!(!m("ml.splitter.*", "ml.splitter.output.x"));
        assert!(!m("ml.splitter.*", "ml.splitterx.output"));
        assert!(m("*.frame", "video.frame"));
        assert!(!m("*.frame", "frame"));
        assert!(m("ml.*.output", "ml.worker.output"));
        assert!(m("*", "single"));
        assert!(!m("*", "two.segments"));
    }

    #[test]
    fn double_star_is_the_rest() {
        assert!(m("ml.**", "ml.a"));
        assert!(m("ml.**", "ml.a.b.c"));
        assert!(!m("ml.**", "ml"));
        assert!(!m("ml.**", "mlx.a"));
        assert!(m("**", "anything.at.all"));
        assert!(m("**", "x"));
        assert!(m("ml.*.**", "ml.a.b"));
        assert!(!m("ml.*.**", "ml.a"));
    }

    /// The byte matcher against a plain reference on segments, over every pairing of a grid.
    #[test]
    fn matcher_agrees_with_a_reference() {
        fn reference(p: &str, t: &str) -> bool {
            let (ps, ts): (Vec<&str>, Vec<&str>) = (p.split('.').collect(), t.split('.').collect());
            if ps.last() == Some(&"**") {
                let fixed = &ps[..ps.len() - 1];
                return ts.len() > fixed.len()
                    && fixed.iter().zip(&ts).all(|(p, t)| *p == "*" || p == t);
            }
            ps.len() == ts.len() && ps.iter().zip(&ts).all(|(p, t)| *p == "*" || p == t)
        }
        let patterns = [
            "a", "*", "**", "a.b", "a.*", "*.b", "a.**", "*.**", "a.b.c", "a.*.c", "ab.c", "a.bc",
            "*.*.*", "a.b.**", "abc.**",
        ];
        let types = [
            "a", "b", "ab", "abc", "a.b", "a.c", "ab.c", "a.bc", "a.b.c", "a.x.c", "a.b.c.d",
            "b.b", "abc.d", "abc", "a.b.cd", "x.y.z",
        ];
        for p in patterns {
            let pat = TypePattern::new(p).unwrap();
            for t in types {
                assert_eq!(pat.matches_str(t), reference(p, t), "{p} on {t}");
            }
        }
    }

    #[test]
    fn same_is_slice_equality() {
        let words = [
            "",
            "a",
            "b",
            "ab",
            "ba",
            "abc",
            "abd",
            "xbc",
            "axc",
            "abcd",
            "abce",
            "abcde",
            "abcdf",
            "xbcde",
            "abxde",
            "abcdefg",
            "abcdefgh",
            "abcdefghi",
            "abcdefghijklmnopq",
            "abcdefghijklmnopr",
            "bbcdefghijklmnopq",
            "abcdefghijklmnopqrstuvwx",
            "abcdefghijklmnopqrstuvwy",
            "abcdefghijklxnopqrstuvwx",
            "abcdefghijklmnopqrstuvwxy",
        ];
        for a in words {
            for b in words {
                assert_eq!(same(a.as_bytes(), b.as_bytes()), a == b, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn bad_patterns_say_why() {
        for (p, why) in [
            ("", "empty"),
            ("a..b", "empty segment"),
            (".a", "empty segment"),
            ("a.**.b", "last segment"),
            ("ml*", "whole segment"),
            ("ml.split*", "whole segment"),
            ("a.b c", "' '"),
        ] {
            let e = TypePattern::new(p).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(e.to_string().contains(why), "{p:?}: {e:#}");
        }
        assert!(TypePattern::new(&"a".repeat(256)).is_err());
        let e = PatternSet::new(Vec::<&str>::new()).unwrap_err();
        assert!(e.to_string().contains("at least one pattern"), "{e:#}");
    }

    #[test]
    fn set_matches_any_and_shows_all() {
        let s = PatternSet::new(["video.frame", "ml.splitter.*"]).unwrap();
        assert!(s.matches(&MsgType::new("ml.splitter.out").unwrap()));
        assert!(s.matches(&MsgType::new("video.frame").unwrap()));
        assert!(!s.matches(&MsgType::new("audio.frame").unwrap()));
        assert_eq!(s.shown(), "[video.frame, ml.splitter.*]");
        assert_eq!(s.patterns().len(), 2);
    }
}
