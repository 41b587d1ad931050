//! `hf bench` end to end: the standard points on every transport with the peer in a second
//! process, the JSON and SVG it writes, the two-machine mode (`--serve` / `--connect`) on
//! loopback, a peer that dies mid-run, and bad command lines.
//!
//! Runs are short (`--duration 0.2`): these check what is reported and that nothing hangs,
//! not how fast anything is (that is what `hf bench` itself is for).

#![cfg(all(feature = "tcp", feature = "shm", feature = "inproc"))]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const GUARD: Duration = Duration::from_secs(90);

fn hf() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hf"));
    cmd.env_remove("RUST_LOG").env_remove("HYPERFRAMES_IO");
    cmd
}

/// A spawned process, killed (and reaped) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to the end, failing the test (and killing it) if it takes longer than the guard.
fn run(cmd: &mut Command) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(GUARD) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{cmd:?} ran for more than {GUARD:?}");
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("hf-bench-test-{}-{name}", std::process::id()))
}

#[test]
fn standard_points_on_every_transport() {
    let (json, svg) = (tmp("all.jsonl"), tmp("all.svg"));
    let out = run(hf()
        .args([
            "bench",
            "--duration",
            "0.2",
            "--warmup",
            "20",
            "--transport",
            "inproc,tcp,tls,shm",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&svg));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("transport  pattern"), "{stdout}");
    assert!(stdout.contains("baseline: memcpy of 4 MiB"), "{stdout}");

    let points = json_lines(&json);
    let mut seen = Vec::new();
    for p in &points {
        let (t, pat, size) = (
            p["transport"].as_str().unwrap(),
            p["pattern"].as_str().unwrap(),
            p["size"].as_u64().unwrap(),
        );
        seen.push(format!("{t} {pat} {size}"));
        assert!(p["messages"].as_u64().unwrap() >= 2, "{p}");
        assert!(p["seconds"].as_f64().unwrap() > 0.0, "{p}");
        let rate = p["msgs_per_s"].as_f64().unwrap();
        let gb = p["gbytes_per_s"].as_f64().unwrap();
        assert!(rate > 0.0, "{p}");
        assert!(
            (gb - rate * size as f64 / 1e9).abs() <= gb * 1e-6 + 1e-12,
            "{p}"
        );
        let cpu = p["cpu"]["user_s"].as_f64().unwrap() + p["cpu"]["sys_s"].as_f64().unwrap();
        assert!(cpu > 0.0, "{p}");
        assert_eq!(p["busy_poll"], false);
        assert_eq!(p["zero_copy"], false);
        if pat == "lat" {
            let l = &p["lat_us"];
            let (p50, p99, p999, max) = (
                l["p50"].as_f64().unwrap(),
                l["p99"].as_f64().unwrap(),
                l["p999"].as_f64().unwrap(),
                l["max"].as_f64().unwrap(),
            );
            assert!(0.0 < p50 && p50 <= p99 && p99 <= p999 && p999 <= max, "{p}");
        } else {
            assert!(p["lat_us"].is_null(), "{p}");
        }
        // Bandwidth points always verify every body.
        assert_eq!(p["verified"], pat == "bw", "{p}");
    }
    let mut want = Vec::new();
    for t in ["inproc", "tcp", "tls", "shm"] {
        for (pat, size) in [("lat", 64), ("rate", 64), ("rate", 32768), ("bw", 4194304)] {
            want.push(format!("{t} {pat} {size}"));
        }
    }
    assert_eq!(seen, want);

    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg"), "not an SVG");
    for caption in ["Bandwidth at the receiver", "Message rate", "Latency"] {
        assert!(svg_text.contains(caption), "no {caption:?} in the plot");
    }
    let _ = std::fs::remove_file(json);
    let _ = std::fs::remove_file(svg);
}

/// Starts `hf bench --serve tcp://127.0.0.1:0` and returns it with the URL it serves.
fn serve() -> (Proc, String) {
    let mut child = hf()
        .args(["bench", "--serve", "tcp://127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("hf bench: serving ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (Proc(child), url)
}

#[test]
fn serve_and_connect_with_offered_load_and_zero_copy() {
    let (_server, url) = serve();
    let json = tmp("remote.jsonl");
    // Twice: the server answers one runner after another.
    for _ in 0..2 {
        let out = run(hf()
            .args([
                "bench",
                "--connect",
                &url,
                "--pattern",
                "lat,bw",
                "--size",
                "4KiB",
            ])
            .args([
                "--duration",
                "0.3",
                "--warmup",
                "0.05s",
                "--rate",
                "2000",
                "--zero-copy",
            ])
            .args(["--verify", "--json"])
            .arg(&json));
        assert!(
            out.status.success(),
            "{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        let points = json_lines(&json);
        assert_eq!(points.len(), 2);
        for p in &points {
            assert_eq!(p["transport"], "tcp");
            assert_eq!(p["zero_copy"], true);
            assert_eq!(p["verified"], true);
            assert_eq!(p["offered_msgs_per_s"], 2000.0);
            // At an offered 2000 msg/s for 0.3 s: 600 messages, all of them received.
            assert_eq!(p["messages"], 600, "{p}");
        }
    }
    let _ = std::fs::remove_file(json);
}

#[test]
fn a_peer_that_dies_fails_the_run_without_hanging() {
    let (mut server, url) = serve();
    let runner = hf()
        .args([
            "bench",
            "--connect",
            &url,
            "--pattern",
            "rate,bw",
            "--duration",
            "60",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut runner = Proc(runner);
    std::thread::sleep(Duration::from_millis(1500));
    server.0.kill().unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(s) = runner.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the runner hangs after its peer died"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(1));
    let mut stdout = String::new();
    std::io::Read::read_to_string(runner.0.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    assert!(stdout.contains("FAILED"), "{stdout}");
}

/// `--buffers 1`: one body sent again and again (as iperf3 does), said in the JSON and in
/// the memcpy baseline, which copies from as many buffers as the sender sends.
#[test]
fn one_buffer_again_and_again() {
    let json = tmp("buffers.jsonl");
    let out = run(hf()
        .args(["bench", "--transport", "inproc", "--pattern", "bw"])
        .args(["--size", "64KiB", "--duration", "0.2", "--warmup", "0.05s"])
        .args(["--buffers", "1", "--json"])
        .arg(&json));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("memcpy of 64 KiB from 1 buffer again and again"),
        "{stdout}"
    );
    let points = json_lines(&json);
    assert_eq!(points.len(), 1);
    assert_eq!(points[0]["buffers"], 1);
    assert_eq!(points[0]["verified"], true);
    let _ = std::fs::remove_file(json);
}

#[test]
fn bad_command_lines_exit_2() {
    for args in [
        &["--size", "4MiB..64"][..],
        &["--warmup", "soon"],
        &["--duration", "0"],
        &["--rate", "-5"],
        &["--transport", "carrier-pigeon"],
        &["--pin", "0,1,2"],
        &["--connect", "nonsense"],
        &["--buffers", "3"],
        &["--buffers", "0"],
        &["--buffers", "128"],
    ] {
        let out = run(hf().arg("bench").args(args));
        assert_eq!(
            out.status.code(),
            Some(2),
            "hf bench {args:?}: {}",
            text(&out.stderr)
        );
        assert!(text(&out.stderr).contains("hf: error:") || text(&out.stderr).contains("error:"));
    }
}

/// `--device stand-in`: device bodies on every transport, the path each took (lent over
/// shm, staged over tcp, handed over in-process), and the device-copy baseline.
#[cfg(feature = "cuda")]
#[test]
fn device_bodies_on_every_path() {
    let json = tmp("device.jsonl");
    let out = run(hf()
        .args([
            "bench",
            "--device",
            "stand-in",
            "--duration",
            "0.2",
            "--warmup",
            "20",
            "--transport",
            "inproc,tcp,shm",
            "--pattern",
            "rate,bw",
            "--size",
            "4KiB",
        ])
        .arg("--json")
        .arg(&json));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("baseline: device-to-device copy of 4 KiB on stand-in"),
        "{stdout}"
    );
    // The counts of each transport's paths, under the table.
    let count = |transport: &str, path: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("note: {transport}: device bodies:")))
            .unwrap_or_else(|| panic!("no device note for {transport}: {stdout}"));
        let at = line.find(path).unwrap_or_else(|| panic!("{line}"));
        line[..at]
            .rsplit([':', ','])
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{e}: {line}"))
    };
    assert!(count("shm", "lent") > 0, "{stdout}");
    assert!(count("tcp", "staged") > 0, "{stdout}");
    assert_eq!(count("tcp", "lent"), 0, "{stdout}");
    assert!(count("inproc", "in-process") > 0, "{stdout}");
    for p in json_lines(&json) {
        assert_eq!(p["device"], "stand-in", "{p}");
        // Only the first body of a point is copied back and checked.
        assert_eq!(p["verified"], false, "{p}");
    }

    // Staged over shm too, on request.
    let out = run(hf().args([
        "bench",
        "--device",
        "stand-in",
        "--no-cuda-ipc",
        "--duration",
        "0.2",
        "--warmup",
        "20",
        "--transport",
        "shm",
        "--pattern",
        "bw",
        "--size",
        "64KiB",
    ]));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("note: shm: device bodies: 0 lent (cuda-ipc)"),
        "{stdout}"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn device_needs_the_feature() {
    let out = run(hf().args(["bench", "--device", "stand-in"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--features cuda"),
        "{}",
        text(&out.stderr)
    );
}
