//! Where io_uring is refused (seccomp in containers, `kernel.io_uring_disabled`), tcp falls
//! back to epoll with one log line, and `HYPERFRAMES_IO=uring` fails with a clear error.
//! The refusal is simulated by strace injecting `EPERM` into `io_uring_setup`, exactly what a
//! seccomp profile answers. Needs strace; `.ci/run` installs it and sets
//! `HF_REQUIRE_STRACE=1` so that the test cannot silently skip there.

use std::process::Command;
use std::time::Duration;

use hyperframes::Context;
use tokio::time::timeout;

fn strace_available() -> bool {
    let ok = Command::new("strace")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("HF_REQUIRE_STRACE").is_none(),
            "strace is required here (HF_REQUIRE_STRACE is set)"
        );
        eprintln!("strace not found: skipping");
    }
    ok
}

/// `hf send` with io_uring refused, as (status, stderr).
fn send_refused(url: &str, engine: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new("strace");
    cmd.args(["-f", "-o", "/dev/null", "-e", "trace=io_uring_setup"])
        .args(["-e", "inject=io_uring_setup:error=EPERM"])
        .arg(env!("CARGO_BIN_EXE_hf"))
        .args([
            "send",
            url,
            "--type",
            "test.fallback",
            "--size",
            "4KiB",
            "--count",
            "3",
        ])
        .env("RUST_LOG", "warn");
    if let Some(e) = engine {
        cmd.env("HYPERFRAMES_IO", e);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_io_uring_falls_back_to_epoll() {
    if !strace_available() {
        return;
    }
    let ctx = Context::new();
    let mut l = ctx.bind("tcp://127.0.0.1:0").await.unwrap();
    let url = l.local_url().to_owned();
    let receiver = tokio::spawn(async move {
        let mut ch = l.accept().await.unwrap();
        let mut n = 0;
        while let Some(m) = ch.recv().await {
            assert_eq!(m.unwrap().body().len(), 4096);
            n += 1;
        }
        n
    });
    // `threads`: I/O threads, io_uring else epoll (inside a tokio runtime, as in `hf send`,
    // `auto` would run the connection inline, on epoll, without trying io_uring).
    let (ok, stderr) = tokio::task::spawn_blocking(move || send_refused(&url, Some("threads")))
        .await
        .unwrap();
    assert!(ok, "hf send failed: {stderr}");
    assert_eq!(
        stderr.matches("tcp:// runs on epoll").count(),
        1,
        "one log line: {stderr}"
    );
    assert_eq!(
        timeout(Duration::from_secs(30), receiver)
            .await
            .unwrap()
            .unwrap(),
        3
    );
}

#[tokio::test]
async fn forced_io_uring_where_refused_is_a_clear_error() {
    if !strace_available() {
        return;
    }
    let (ok, stderr) =
        tokio::task::spawn_blocking(|| send_refused("tcp://127.0.0.1:9", Some("uring")))
            .await
            .unwrap();
    assert!(!ok);
    assert!(stderr.contains("io_uring is not available"), "{stderr}");
    assert!(stderr.contains("HYPERFRAMES_IO"), "{stderr}");
}

/// `hf doctor` where io_uring is refused: the io_uring finding warns, says tcp:// runs on
/// epoll and gives the fix; the exit status stays 0.
#[test]
fn doctor_reports_refused_io_uring() {
    if !strace_available() {
        return;
    }
    let out = Command::new("strace")
        .args(["-f", "-o", "/dev/null", "-e", "trace=io_uring_setup"])
        .args(["-e", "inject=io_uring_setup:error=EPERM"])
        .arg(env!("CARGO_BIN_EXE_hf"))
        .args(["doctor", "--json"])
        .env_remove("HYPERFRAMES_IO")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout
        .lines()
        .find(|l| l.contains("\"check\":\"io_uring\""))
        .unwrap_or_else(|| panic!("no io_uring finding: {stdout}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["status"], "warn", "{line}");
    assert!(
        v["found"].as_str().unwrap().contains("fall back to epoll"),
        "{line}"
    );
    assert!(
        v["fix"].as_str().unwrap().contains("io_uring_setup"),
        "{line}"
    );
}
