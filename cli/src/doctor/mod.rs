//! `hf doctor`: the deployment checklist as a command.
//!
//! Every check yields one or more [`Finding`]s: what was found, whether it is good for
//! speed, and the exact fix when it is not. Nothing here fails because something is
//! missing: a missing device, file or module is itself the finding. The checks read
//! `/proc` and `/sys` through a [`Host`] rooted at `/` (a fake tree in tests); only
//! `io_uring` and `shm` do more, opening a loopback connection through the library.

use clap::Args;
use std::fmt::Write as _;
use std::io::{self, Write as _};

use self::gpu::{
    check_cuda, check_cuda_driver, check_gpudirect, check_gpus, nvidia_gpus, probe_cuda,
};
use self::host::{Env, Host, sysctl_path};
use self::io_uring::check_io_uring;
use self::memlock::check_memlock;
use self::net::{check_core_buffer, check_mtu, check_tcp_buffer};
use self::numa::check_numa;
use self::probe::{probe_shm, probe_tcp};
use self::rdma::{check_rdma, check_rdma_cm, check_uverbs, rdma_ports};
use self::shm::{check_dev_shm, check_shm};
use self::system::{check_governor, check_hugepages, check_thp};
use crate::Failure;

mod gpu;
mod host;
mod io_uring;
mod memlock;
mod net;
mod numa;
mod probe;
mod rdma;
mod shm;
mod system;

#[cfg(test)]
mod fake;

/// Printed after `hf doctor --help`.
pub(crate) const AFTER_HELP: &str = "\
Checks, in order: io_uring (probed with a loopback tcp:// connection), memlock, rdma, uverbs,
rdma_cm, cuda, gpu, gpudirect, numa, mtu, cpu_governor, thp, hugepages, net.core.rmem_max,
net.core.wmem_max, net.ipv4.tcp_rmem, net.ipv4.tcp_wmem, shm (probed with a loopback shm://
connection), dev_shm, cuda_driver (hyperframes' own CUDA entry point, in a build with feature
`cuda`). Some checks give one finding per device, port or interface.

Status: ok (good for speed), warn (costs speed or breaks a transport; a fix follows),
info (worth knowing; a fix may follow), absent (the hardware or software is not there),
error (the check itself could not run). The exit status is 0 whatever was found.

Output: one line per finding, `fix:` lines under it; with --json, one JSON object per finding
and line: {\"check\":\"memlock\",\"status\":\"warn\",\"found\":\"…\",\"fix\":\"…\"} (fix is null when
there is nothing to do).";

/// Every check, in report order; each gives at least one finding.
#[cfg(test)]
const CHECKS: [&str; 20] = [
    "io_uring",
    "memlock",
    "rdma",
    "uverbs",
    "rdma_cm",
    "cuda",
    "gpu",
    "gpudirect",
    "numa",
    "mtu",
    "cpu_governor",
    "thp",
    "hugepages",
    "net.core.rmem_max",
    "net.core.wmem_max",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "shm",
    "dev_shm",
    "cuda_driver",
];

/// Arguments of `hf doctor`.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object per finding and line instead of the table.
    #[arg(long)]
    json: bool,
}

/// How a finding bears on speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// Good as it is.
    Ok,
    /// Costs speed, or keeps a transport from working; the finding has a fix.
    Warn,
    /// Worth knowing; not wrong.
    Info,
    /// The hardware or software is not there.
    Absent,
    /// The check could not run.
    Error,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Info => "info",
            Status::Absent => "absent",
            Status::Error => "error",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Finding {
    check: &'static str,
    status: Status,
    found: String,
    /// The exact command or setting that makes it good; lines separated by `\n`.
    fix: Option<String>,
}

impl Finding {
    fn new(check: &'static str, status: Status, found: impl Into<String>) -> Finding {
        Finding {
            check,
            status,
            found: found.into(),
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Finding {
        self.fix = Some(fix.into());
        self
    }

    /// The JSON line, without the newline: `{"check":…,"status":…,"found":…,"fix":…|null}`.
    fn json(&self) -> String {
        let s = |v: &str| serde_json::to_string(v).expect("a str always serializes");
        format!(
            "{{\"check\":{},\"status\":{},\"found\":{},\"fix\":{}}}",
            s(self.check),
            s(self.status.as_str()),
            s(&self.found),
            self.fix.as_deref().map_or_else(|| "null".to_owned(), s)
        )
    }
}

/// The table: a status column, a check column, the finding, and `fix:` lines under it.
fn render(findings: &[Finding]) -> String {
    let width = findings.iter().map(|f| f.check.len()).max().unwrap_or(0);
    let indent = " ".repeat(8 + width + 2);
    let mut out = String::new();
    for f in findings {
        let _ = writeln!(
            out,
            "{:<8}{:<width$}  {}",
            f.status.as_str(),
            f.check,
            f.found
        );
        if let Some(fix) = &f.fix {
            for (i, line) in fix.lines().enumerate() {
                let head = if i == 0 { "fix: " } else { "     " };
                let _ = writeln!(out, "{indent}{head}{line}");
            }
        }
    }
    let mut counts = String::new();
    for status in [
        Status::Ok,
        Status::Warn,
        Status::Info,
        Status::Absent,
        Status::Error,
    ] {
        let n = findings.iter().filter(|f| f.status == status).count();
        if n > 0 {
            let _ = write!(counts, ", {n} {}", status.as_str());
        }
    }
    let _ = writeln!(out, "\n{} findings{counts}", findings.len());
    out
}

/// Runs `hf doctor`.
pub(crate) async fn run(args: DoctorArgs) -> Result<(), Failure> {
    let host = Host::real();
    let env = Env::current();
    let mut findings = vec![check_io_uring(&host, &env, probe_tcp().await)];
    findings.extend(survey(&host, &env));
    findings.push(check_shm(&host, &env, probe_shm().await));
    findings.push(check_dev_shm(&host));
    findings.push(check_cuda_driver(probe_cuda()));
    let text = if args.json {
        findings.iter().map(|f| f.json() + "\n").collect()
    } else {
        render(&findings)
    };
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        // `hf doctor | head`: the reader has what it wanted.
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            Err(Failure::runtime(format!("writing to stdout: {e:#}")))
        }
        _ => Ok(()),
    }
}

/// Everything but the two probes and `/dev/shm`, in report order.
fn survey(host: &Host, env: &Env) -> Vec<Finding> {
    let ports = rdma_ports(host);
    let gpus = nvidia_gpus(host);
    let mut findings = vec![check_memlock(
        host.read("/proc/self/limits").as_deref(),
        host.read("/proc/self/status").as_deref(),
    )];
    findings.extend(check_rdma(host, &ports));
    findings.extend(check_uverbs(host, &ports));
    findings.push(check_rdma_cm(host, &ports));
    findings.push(check_cuda(host, &gpus, env));
    findings.extend(check_gpus(&gpus));
    findings.push(check_gpudirect(host, &gpus, !ports.is_empty()));
    findings.push(check_numa(host, &ports, &gpus));
    findings.extend(check_mtu(host, &ports));
    findings.push(check_governor(host));
    findings.push(check_thp(host));
    findings.push(check_hugepages(host.read("/proc/meminfo").as_deref()));
    for name in ["net.core.rmem_max", "net.core.wmem_max"] {
        findings.push(check_core_buffer(
            name,
            host.read(&sysctl_path(name)).as_deref(),
        ));
    }
    for name in ["net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"] {
        findings.push(check_tcp_buffer(
            name,
            host.read(&sysctl_path(name)).as_deref(),
        ));
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::Fake;
    use crate::doctor::gpu::nvidia_driver;
    use crate::doctor::host::{kernel_version, natural_key};
    use crate::doctor::memlock::has_ipc_lock;
    use crate::doctor::rdma::sysfs_word;
    use crate::doctor::shm::{approx_bytes, effective_uid};
    use crate::doctor::system::bracketed;

    /// Odd contents in every file the checks read: findings, never a panic.
    #[test]
    fn odd_sysfs_contents_do_not_panic() {
        for odd in [
            "",
            "\u{0}\u{ff}garbage[",
            "-1",
            "99999999999999999999999",
            "4:",
            ":",
            "[]",
        ] {
            let fake = Fake::new();
            fake.roce(odd, odd)
                .netdev("eth2", 0, 0)
                .gpu("0000:3b:00.0", -1, 0)
                .file("/sys/class/net/eth2/mtu", odd)
                .file("/sys/class/net/eth2/flags", "0x1")
                .file("/sys/class/infiniband/mlx5_0/ports/1/gids/0", odd)
                .file("/sys/class/infiniband/mlx5_0/ports/1/link_layer", odd)
                .file("/sys/class/infiniband/mlx5_0/device/numa_node", odd)
                .file("/sys/bus/pci/devices/0000:3b:00.0/current_link_width", odd)
                .file("/proc/driver/nvidia/version", odd)
                .file("/proc/driver/nvidia/gpus/0000:3b:00.0/information", odd)
                .file("/proc/sys/kernel/osrelease", odd)
                .file("/sys/devices/system/node/node0/cpulist", odd)
                .file("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", odd)
                .file("/sys/kernel/mm/transparent_hugepage/enabled", odd)
                .file("/proc/self/limits", odd)
                .file("/proc/self/status", odd)
                .file("/proc/meminfo", odd)
                .file("/proc/sys/net/core/rmem_max", odd)
                .file("/proc/sys/net/ipv4/tcp_rmem", odd)
                .file("/etc/ld.so.cache", odd);
            let findings = survey(&fake.host(), &Env::default());
            for check in CHECKS
                .iter()
                .filter(|c| !["io_uring", "shm", "dev_shm", "cuda_driver"].contains(c))
            {
                assert!(
                    findings.iter().any(|f| f.check == *check),
                    "{odd:?}: no {check}"
                );
            }
            for f in &findings {
                assert!(!f.found.is_empty(), "{f:#?}");
            }
        }
    }

    #[test]
    fn every_check_answers_on_an_empty_host() {
        let findings = survey(&Fake::new().host(), &Env::default());
        let names: Vec<_> = findings.iter().map(|f| f.check).collect();
        let expected: Vec<_> = CHECKS
            .iter()
            .copied()
            .filter(|c| !["io_uring", "shm", "dev_shm", "cuda_driver"].contains(c))
            .collect();
        assert_eq!(names, expected);
        for check in CHECKS {
            assert!(AFTER_HELP.contains(check), "--help does not name {check}");
        }
    }

    #[test]
    fn json_and_table() {
        let findings = [
            Finding::new("memlock", Status::Warn, "64 KiB \"pinned\"")
                .fix("ulimit -l unlimited\n* hard memlock unlimited"),
            Finding::new("net.core.rmem_max", Status::Ok, "64 MiB"),
        ];
        let v: serde_json::Value = serde_json::from_str(&findings[0].json()).unwrap();
        assert_eq!(v["check"], "memlock");
        assert_eq!(v["status"], "warn");
        assert_eq!(v["found"], "64 KiB \"pinned\"");
        assert_eq!(v["fix"], "ulimit -l unlimited\n* hard memlock unlimited");
        assert!(
            findings[1].json().ends_with("\"fix\":null}"),
            "{}",
            findings[1].json()
        );
        assert!(
            findings[0]
                .json()
                .starts_with("{\"check\":\"memlock\",\"status\":")
        );

        let table = render(&findings);
        assert_eq!(
            table,
            "warn    memlock            64 KiB \"pinned\"\n\
             \x20                          fix: ulimit -l unlimited\n\
             \x20                               * hard memlock unlimited\n\
             ok      net.core.rmem_max  64 MiB\n\
             \n\
             2 findings, 1 ok, 1 warn\n"
        );
    }

    #[test]
    fn small_parsers() {
        assert_eq!(kernel_version("6.8.0-45-generic"), Some((6, 8)));
        assert_eq!(kernel_version("5.12"), Some((5, 12)));
        assert_eq!(kernel_version("garbage"), None);
        assert_eq!(sysfs_word("4: ACTIVE"), "ACTIVE");
        assert_eq!(sysfs_word("LinkUp"), "LinkUp");
        assert_eq!(bracketed("always [madvise] never"), Some("madvise"));
        assert_eq!(bracketed("]["), None);
        assert_eq!(
            nvidia_driver(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
            ),
            Some(("570.86.15".to_owned(), true))
        );
        assert_eq!(nvidia_driver("NVRM version: x86_64 1. .2"), None);
        assert_eq!(effective_uid("Uid:\t0\t1000\t0\t0"), Some(1000));
        assert!(has_ipc_lock("CapEff:\t0000000000004000"));
        assert!(!has_ipc_lock("CapEff:\t0000000000003fff"));
        assert_eq!(approx_bytes(25 << 30), "25.0 GiB");
        assert_eq!(approx_bytes(100), "100 bytes");
        let mut names = vec![
            "node10".to_owned(),
            "node2".to_owned(),
            "node1".to_owned(),
            "eth".to_owned(),
        ];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["eth", "node1", "node2", "node10"]);
    }
}
