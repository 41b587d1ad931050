//! What `hf listen` prints: one JSON line per message, counted across connections.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::sync::Mutex;

use hyperframes::{Message, Meta, MsgType, escape_untrusted};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

use crate::Failure;

/// Lowercase hex of the SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// `json` (serde_json's output) with what a terminal would still act on written as `\uXXXX`:
/// serde_json escapes what JSON requires (`"`, `\\`, U+0000–U+001F), but DEL, the C1
/// controls (U+009B is a CSI), bidirectional overrides and line separators — the characters
/// `escape_untrusted` escapes — pass through. They can only be inside strings (the rest of
/// the line is ASCII punctuation, digits and `null`), where the escape decodes to the same
/// character: the line stays valid JSON of the same value, and shows as it is.
fn terminal_safe(json: String) -> String {
    if matches!(escape_untrusted(&json), Cow::Borrowed(_)) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if matches!(escape_untrusted(c.encode_utf8(&mut [0; 4])), Cow::Owned(_)) {
            // Each of them is in the Basic Multilingual Plane: one `\u` escape.
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// What `hf listen` prints of a message (the type and metadata through hyperframes' serde
/// forms, the metadata in the message's order).
#[derive(Serialize)]
struct Line<'a> {
    #[serde(rename = "type")]
    kind: &'a MsgType,
    meta: &'a Meta,
    len: usize,
    /// `None` (`null`) for a body outside host memory.
    sha256: Option<String>,
}

/// The JSON line for `msg`, without the newline:
/// `{"type":"a.b","meta":{"k":"v"},"len":3,"sha256":"…"}`.
pub(crate) fn json_line(msg: &Message) -> String {
    let line = Line {
        kind: msg.kind(),
        meta: msg.meta(),
        len: msg.body().len(),
        sha256: msg.body().as_bytes().map(|b| sha256_hex(b)),
    };
    terminal_safe(serde_json::to_string(&line).expect("strings and numbers always serialize"))
}

/// Flushes stdout, ignoring errors (used on the way out).
pub(crate) fn flush_stdout() {
    let _ = io::stdout().lock().flush();
}

/// Prints lines to stdout for every connection, one whole line at a time, and counts them.
pub(crate) struct Printer {
    state: Mutex<State>,
    limit: Option<u64>,
    done: Notify,
}

struct State {
    printed: u64,
    /// Set once nothing more is printed: `Ok` when the count was reached (or stdout was
    /// closed by its reader), `Err` when stdout failed.
    end: Option<Result<(), Failure>>,
}

impl Printer {
    /// A printer that finishes after `limit` lines, or never.
    pub(crate) fn new(limit: Option<u64>) -> Printer {
        let printer = Printer {
            state: Mutex::new(State {
                printed: 0,
                end: None,
            }),
            limit,
            done: Notify::new(),
        };
        if limit == Some(0) {
            printer.finish(&mut printer.state.lock().expect("not poisoned"), Ok(()));
        }
        printer
    }

    fn finish(&self, state: &mut State, end: Result<(), Failure>) {
        if state.end.is_none() {
            state.end = Some(end);
            // The permit is stored when `finished` is not waiting yet.
            self.done.notify_one();
        }
    }

    /// Prints `line` and a newline, and flushes. Returns `false` when the caller should stop
    /// receiving: the count has been reached (by this line or before: a line past the count
    /// is not printed) or stdout is gone.
    pub(crate) fn print(&self, line: &str) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.end.is_some() {
            return false;
        }
        let written = {
            let mut out = io::stdout().lock();
            out.write_all(line.as_bytes())
                .and_then(|()| out.write_all(b"\n"))
                .and_then(|()| out.flush())
        };
        match written {
            Ok(()) => {
                state.printed += 1;
                if Some(state.printed) == self.limit {
                    self.finish(&mut state, Ok(()));
                    return false;
                }
                true
            }
            // `hf listen | head -1`: the reader has what it wanted.
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                self.finish(&mut state, Ok(()));
                false
            }
            Err(e) => {
                self.finish(
                    &mut state,
                    Err(Failure::runtime(format!("writing to stdout: {e:#}"))),
                );
                false
            }
        }
    }

    /// Waits until the count is reached or stdout failed.
    pub(crate) async fn finished(&self) -> Result<(), Failure> {
        loop {
            {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(end) = state.end.take() {
                    // Keep `end` set so that `print` refuses from now on.
                    state.end = Some(Ok(()));
                    return end;
                }
            }
            self.done.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_keep_meta_order_and_escape() {
        let msg = Message::new("demo.hello")
            .unwrap()
            .with_meta("z", "1")
            .unwrap()
            .with_meta("a", "say \"hi\"\n✓")
            .unwrap()
            .with_body(&b"abc"[..]);
        let line = json_line(&msg);
        assert_eq!(
            line,
            "{\"type\":\"demo.hello\",\"meta\":{\"z\":\"1\",\"a\":\"say \\\"hi\\\"\\n✓\"},\
             \"len\":3,\"sha256\":\
             \"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\"}"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["meta"]["a"], "say \"hi\"\n✓");

        let empty = json_line(&Message::new("e").unwrap());
        assert_eq!(
            empty,
            "{\"type\":\"e\",\"meta\":{},\"len\":0,\"sha256\":\
             \"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\"}"
        );
    }

    /// A peer's metadata cannot drive the terminal through `hf listen`: the 8-bit CSI, a
    /// right-to-left override, DEL and a line separator come out as `\u` escapes, and the line
    /// still decodes to the very string that was sent.
    #[test]
    fn json_lines_escape_what_a_terminal_would_act_on() {
        let hostile = "a\u{9b}2Jb\u{202e}gnp.exe\u{7f}\u{2028}\u{1b}]0;title\u{7}";
        let msg = Message::new("demo.hello")
            .unwrap()
            .with_meta("k", hostile)
            .unwrap();
        let line = json_line(&msg);
        for c in [
            '\u{9b}', '\u{202e}', '\u{7f}', '\u{2028}', '\u{1b}', '\u{7}',
        ] {
            assert!(!line.contains(c), "{c:?} raw in {line}");
        }
        assert!(
            line.contains("\\u009b") && line.contains("\\u202e"),
            "{line}"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["meta"]["k"], hostile);
        let plain = "\"plain ✓\"".to_owned();
        assert_eq!(terminal_safe(plain.clone()), plain);
    }
}
