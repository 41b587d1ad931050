//! io_uring: whether the kernel lets us use it, and what the tcp:// probe chose.

use std::fmt::Write as _;

use hyperframes::IoEngine;

use super::host::{Env, Host, kernel_version};
use super::probe::Probe;
use super::{Finding, Status};

pub(super) fn check_io_uring(host: &Host, env: &Env, probe: Probe) -> Finding {
    const CHECK: &str = "io_uring";
    let disabled = host.read("/proc/sys/kernel/io_uring_disabled");
    let release = host.read("/proc/sys/kernel/osrelease");
    let mut facts = Vec::new();
    if let Some(r) = &release {
        facts.push(format!("Linux {r}"));
    }
    match &disabled {
        Some(d) => facts.push(format!("kernel.io_uring_disabled = {d}")),
        None => facts.push("no kernel.io_uring_disabled".to_owned()),
    }
    let facts = facts.join(", ");
    let forced = env
        .hyperframes_io
        .as_deref()
        .filter(|v| !v.eq_ignore_ascii_case("auto"));
    let mut finding = match probe {
        Probe::Worked(Some(IoEngine::Uring)) => Finding::new(
            CHECK,
            Status::Ok,
            format!(
                "available: tcp://'s I/O threads run on io_uring (loopback probe; {facts}); \
                 connections made inside a tokio runtime run inline, on epoll"
            ),
        ),
        Probe::Worked(engine) => {
            let engine = engine.map_or_else(|| "an unknown engine".to_owned(), |e| e.to_string());
            let (why, fix) = match disabled.as_deref() {
                Some("2") => (
                    "kernel.io_uring_disabled = 2 turns io_uring off for everyone".to_owned(),
                    "sudo sysctl -w kernel.io_uring_disabled=0".to_owned(),
                ),
                Some("1") => {
                    let group = host
                        .read("/proc/sys/kernel/io_uring_group")
                        .unwrap_or_else(|| "?".to_owned());
                    (
                        format!(
                            "kernel.io_uring_disabled = 1 allows it only to group {group} \
                             (kernel.io_uring_group)"
                        ),
                        format!(
                            "sudo sysctl -w kernel.io_uring_disabled=0\n\
                             or add this user to the group with id {group}"
                        ),
                    )
                }
                _ if release
                    .as_deref()
                    .and_then(kernel_version)
                    .is_some_and(|v| v < (5, 10)) =>
                {
                    (
                        "the kernel is older than 5.10".to_owned(),
                        "upgrade to Linux 5.10 or later".to_owned(),
                    )
                }
                _ => (
                    "most likely a seccomp filter (Docker's default profile refuses io_uring)"
                        .to_owned(),
                    "run with a seccomp profile that allows io_uring_setup, io_uring_enter \
                     and io_uring_register (docker run --security-opt seccomp=PROFILE.json)"
                        .to_owned(),
                ),
            };
            Finding::new(
                CHECK,
                Status::Warn,
                format!("refused: tcp://'s I/O threads fall back to {engine}; {why} ({facts})"),
            )
            .fix(fix)
        }
        Probe::NotBuilt => Finding::new(
            CHECK,
            Status::Info,
            format!("tcp:// is not in this build (feature `tcp`); {facts}"),
        )
        .fix("cargo install hyperframes --features tcp"),
        Probe::Failed(e) => Finding::new(
            CHECK,
            Status::Error,
            format!("the tcp:// loopback probe failed: {e:#} ({facts})"),
        ),
    };
    if let Some(v) = forced {
        let lower = v.to_ascii_lowercase();
        if ![
            "uring", "io_uring", "io-uring", "epoll", "inline", "threads",
        ]
        .contains(&lower.as_str())
        {
            let _ = write!(
                finding.found,
                "; HYPERFRAMES_IO={v:?} is not understood (auto, inline, threads, uring or epoll): \
                 hf refuses it and Context::new() ignores it"
            );
            finding.status = Status::Warn;
            finding.fix = Some("unset HYPERFRAMES_IO".to_owned());
        } else if lower == "epoll" || lower == "inline" {
            let _ = write!(
                finding.found,
                "; HYPERFRAMES_IO={v} makes tcp:// use {lower} instead"
            );
            if finding.status == Status::Ok {
                finding.status = Status::Info;
                finding.fix = Some("unset HYPERFRAMES_IO    (to run on io_uring)".to_owned());
            }
        } else {
            let _ = write!(finding.found, "; HYPERFRAMES_IO={v}");
        }
    }
    finding
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has};

    #[test]
    fn io_uring_judgements() {
        let fake = Fake::new();
        fake.file("/proc/sys/kernel/io_uring_disabled", "0")
            .file("/proc/sys/kernel/osrelease", "6.8.0");
        let env = Env::default();
        let f = check_io_uring(&fake.host(), &env, Probe::Worked(Some(IoEngine::Uring)));
        assert_has(
            &f,
            Status::Ok,
            &[
                "I/O threads run on io_uring",
                "Linux 6.8.0",
                "kernel.io_uring_disabled = 0",
            ],
            &[],
        );
        let f = check_io_uring(&fake.host(), &env, Probe::Worked(Some(IoEngine::Epoll)));
        assert_has(
            &f,
            Status::Warn,
            &["fall back to epoll", "seccomp"],
            &["io_uring_setup"],
        );

        fake.file("/proc/sys/kernel/io_uring_disabled", "2");
        let f = check_io_uring(&fake.host(), &env, Probe::Worked(Some(IoEngine::Epoll)));
        assert_has(
            &f,
            Status::Warn,
            &["kernel.io_uring_disabled = 2"],
            &["sudo sysctl -w kernel.io_uring_disabled=0"],
        );
        fake.file("/proc/sys/kernel/io_uring_disabled", "1")
            .file("/proc/sys/kernel/io_uring_group", "1234");
        let f = check_io_uring(&fake.host(), &env, Probe::Worked(Some(IoEngine::Epoll)));
        assert_has(
            &f,
            Status::Warn,
            &["group 1234"],
            &["kernel.io_uring_disabled=0", "1234"],
        );

        let forced = Env {
            hyperframes_io: Some("epoll".to_owned()),
            ..Env::default()
        };
        fake.file("/proc/sys/kernel/io_uring_disabled", "0");
        let f = check_io_uring(&fake.host(), &forced, Probe::Worked(Some(IoEngine::Uring)));
        assert_has(
            &f,
            Status::Info,
            &["HYPERFRAMES_IO=epoll makes tcp:// use epoll"],
            &["unset HYPERFRAMES_IO"],
        );
        let bad = Env {
            hyperframes_io: Some("fast".to_owned()),
            ..Env::default()
        };
        let f = check_io_uring(&fake.host(), &bad, Probe::Worked(Some(IoEngine::Uring)));
        assert_has(
            &f,
            Status::Warn,
            &["\"fast\" is not understood"],
            &["unset"],
        );
        let uring = Env {
            hyperframes_io: Some("URING".to_owned()),
            ..Env::default()
        };
        let f = check_io_uring(&fake.host(), &uring, Probe::Worked(Some(IoEngine::Uring)));
        assert_has(&f, Status::Ok, &["HYPERFRAMES_IO=URING"], &[]);

        let f = check_io_uring(&fake.host(), &env, Probe::Failed("boom".to_owned()));
        assert_has(&f, Status::Error, &["boom"], &[]);
        let f = check_io_uring(&fake.host(), &env, Probe::NotBuilt);
        assert_eq!(f.status, Status::Info);
    }
}
