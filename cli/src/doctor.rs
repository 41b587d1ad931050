//! `hf doctor`: the deployment checklist as a command.
//!
//! Every check yields one or more [`Finding`]s: what was found, whether it is good for
//! speed, and the exact fix when it is not. Nothing here fails because something is
//! missing: a missing device, file or module is itself the finding. The checks read
//! `/proc` and `/sys` through a [`Host`] rooted at `/` (a fake tree in tests); only
//! `io_uring` and `shm` do more, opening a loopback connection through the library.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::net::Ipv6Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use hyperframes::{Context, ErrorKind, IoEngine, Message};

use crate::Failure;
use crate::units::human_bytes;

/// Printed after `hf doctor --help`.
pub(crate) const AFTER_HELP: &str = "\
Checks, in order: io_uring (probed with a loopback tcp:// connection), memlock, rdma, uverbs,
cuda, gpu, gpudirect, numa, mtu, cpu_governor, thp, hugepages, net.core.rmem_max,
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
const CHECKS: [&str; 19] = [
    "io_uring",
    "memlock",
    "rdma",
    "uverbs",
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

// ---------------------------------------------------------------------------------------------
// Where the facts come from.

/// The file system the checks read: `/` itself, or a fake tree in tests.
struct Host {
    root: PathBuf,
}

impl Host {
    fn real() -> Host {
        Host::at("/")
    }

    fn at(root: impl Into<PathBuf>) -> Host {
        Host { root: root.into() }
    }

    /// `path` (absolute, as on a real host) under the root.
    fn path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    /// The trimmed contents of a file; `None` when it cannot be read as text (missing,
    /// refused, not UTF-8, or a sysfs attribute that errors on read).
    fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.path(path))
            .ok()
            .map(|s| s.trim().to_owned())
    }

    fn read_num<T: std::str::FromStr>(&self, path: &str) -> Option<T> {
        self.read(path)?.parse().ok()
    }

    fn exists(&self, path: &str) -> bool {
        self.path(path).exists()
    }

    /// The names in a directory, in natural order (`node2` before `node10`); empty when it
    /// cannot be read.
    fn list(&self, path: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.path(path))
            .map(|dir| {
                dir.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort_by_key(|n| natural_key(n));
        names
    }
}

/// `"uverbs10"` → `("uverbs", 10)`, so that numbered names sort by number.
fn natural_key(name: &str) -> (String, u64, String) {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    let number = name[stem.len()..].parse().unwrap_or(0);
    (stem.to_owned(), number, name.to_owned())
}

/// The environment variables the checks look at.
#[derive(Default)]
struct Env {
    hyperframes_io: Option<String>,
    xdg_runtime_dir: Option<String>,
    ld_library_path: Option<String>,
}

impl Env {
    fn current() -> Env {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        Env {
            hyperframes_io: var("HYPERFRAMES_IO"),
            xdg_runtime_dir: var("XDG_RUNTIME_DIR"),
            ld_library_path: var("LD_LIBRARY_PATH"),
        }
    }
}

fn sysctl_path(name: &str) -> String {
    format!("/proc/sys/{}", name.replace('.', "/"))
}

/// `"6.8.0-45-generic"` → `(6, 8)`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// A sysfs `numa_node`: `None` for -1 (no affinity reported) or anything unreadable.
fn numa_node(host: &Host, path: &str) -> Option<u32> {
    host.read_num::<i64>(path)
        .and_then(|n| u32::try_from(n).ok())
}

// ---------------------------------------------------------------------------------------------
// Loopback probes through the library.

/// What a loopback connection through the library showed.
#[derive(Debug)]
enum Probe {
    /// A message went through; for `tcp://`, the engine the context chose.
    Worked(Option<IoEngine>),
    /// The transport is not compiled into this build.
    NotBuilt,
    /// Something failed; the library's error.
    Failed(String),
}

const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `url`, connects to it and sends one message across.
async fn loopback(ctx: &Context, url: &str) -> Probe {
    let attempt = async {
        let mut listener = ctx.bind(url).await?;
        let at = listener.local_url().to_owned();
        let (accepted, connected) = tokio::join!(listener.accept(), ctx.connect(&at));
        let (mut server, mut client) = (accepted?, connected?);
        client
            .send(Message::new("hf.doctor")?.with_body(&b"ping"[..]))
            .await?;
        client.flush().await?;
        match server.recv().await {
            Some(Ok(msg)) if msg.body().as_bytes().is_some_and(|b| b[..] == b"ping"[..]) => {
                Ok(true)
            }
            Some(Err(e)) => Err(e),
            _ => Ok(false),
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(Ok(true)) => Probe::Worked(ctx.io_engine()),
        Ok(Ok(false)) => Probe::Failed("the message did not arrive intact".to_owned()),
        Ok(Err(e)) if e.kind() == ErrorKind::UnsupportedScheme => Probe::NotBuilt,
        Ok(Err(e)) => Probe::Failed(e.to_string()),
        Err(_) => Probe::Failed(format!("no answer within {PROBE_TIMEOUT:?}")),
    }
}

/// A `tcp://` loopback connection on the I/O threads left to choose io_uring or epoll
/// (`Threads`, what `Auto` picks where no tokio runtime runs the connection inline).
async fn probe_tcp() -> Probe {
    match Context::builder().io_engine(IoEngine::Threads).build() {
        Ok(ctx) => loopback(&ctx, "tcp://127.0.0.1:0").await,
        Err(e) => Probe::Failed(e.to_string()),
    }
}

/// A `shm://` loopback connection, through the runtime directory as `shm://NAME` uses it.
async fn probe_shm() -> Probe {
    match Context::builder().build() {
        Ok(ctx) => loopback(&ctx, &format!("shm://hf-doctor-{}", std::process::id())).await,
        Err(e) => Probe::Failed(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// io_uring

fn check_io_uring(host: &Host, env: &Env, probe: Probe) -> Finding {
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

// ---------------------------------------------------------------------------------------------
// memlock

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
fn has_ipc_lock(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

fn check_memlock(limits: Option<&str>, status: Option<&str>) -> Finding {
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

// ---------------------------------------------------------------------------------------------
// RDMA

/// One port of an RDMA device, as sysfs shows it.
#[derive(Debug)]
struct RdmaPort {
    device: String,
    port: String,
    /// `ACTIVE`, `DOWN`, `INIT`… (the word after `4: `).
    state: String,
    phys_state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    link_layer: String,
    rate: Option<String>,
    /// The Ethernet device under a RoCE port.
    netdev: Option<String>,
    netdev_mtu: Option<u32>,
    /// Non-zero GIDs: index, address, type (`RoCE v2`, `IB/RoCE v1`).
    gids: Vec<(u32, Ipv6Addr, Option<String>)>,
    numa: Option<u32>,
}

/// `"4: ACTIVE"` → `"ACTIVE"`.
fn sysfs_word(text: &str) -> String {
    text.split_once(':')
        .map_or(text, |(_, w)| w)
        .trim()
        .to_owned()
}

/// The largest IB MTU a RoCE port gets over a netdev of `mtu` bytes (the kernel's
/// `iboe_get_mtu`: the MTU less 96 bytes of GRH, UDP, BTH, extended headers and ICRC).
fn roce_active_mtu(mtu: u32) -> Option<u32> {
    let room = mtu.checked_sub(96)?;
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&m| room >= m)
}

fn rdma_ports(host: &Host) -> Vec<RdmaPort> {
    let mut ports = Vec::new();
    for device in host.list("/sys/class/infiniband") {
        let dev_dir = format!("/sys/class/infiniband/{device}");
        let numa = numa_node(host, &format!("{dev_dir}/device/numa_node"));
        // The PCI function's netdev (mlx5), or the `parent` of a software device (rxe).
        let pci_netdev = host
            .list(&format!("{dev_dir}/device/net"))
            .into_iter()
            .next()
            .or_else(|| host.read(&format!("{dev_dir}/parent")));
        for port in host.list(&format!("{dev_dir}/ports")) {
            let dir = format!("{dev_dir}/ports/{port}");
            let read = |name: &str| host.read(&format!("{dir}/{name}"));
            let mut gids = Vec::new();
            let mut gid_netdev = None;
            for index in host.list(&format!("{dir}/gids")).into_iter().take(256) {
                let Ok(i) = index.parse::<u32>() else {
                    continue;
                };
                let Some(addr) = read(&format!("gids/{i}")).and_then(|g| g.parse().ok()) else {
                    continue;
                };
                if addr == Ipv6Addr::UNSPECIFIED {
                    continue;
                }
                if gid_netdev.is_none() {
                    gid_netdev = read(&format!("gid_attrs/ndevs/{i}"));
                }
                gids.push((i, addr, read(&format!("gid_attrs/types/{i}"))));
            }
            let link_layer = read("link_layer").unwrap_or_else(|| "unknown".to_owned());
            let netdev = if link_layer == "Ethernet" {
                gid_netdev.or_else(|| pci_netdev.clone())
            } else {
                None
            };
            let netdev_mtu = netdev
                .as_ref()
                .and_then(|n| host.read_num(&format!("/sys/class/net/{n}/mtu")));
            ports.push(RdmaPort {
                device: device.clone(),
                port,
                state: read("state").map_or_else(|| "unknown".to_owned(), |s| sysfs_word(&s)),
                phys_state: read("phys_state")
                    .map_or_else(|| "unknown".to_owned(), |s| sysfs_word(&s)),
                link_layer,
                rate: read("rate"),
                netdev,
                netdev_mtu,
                gids,
                numa,
            });
        }
    }
    ports
}

fn check_rdma(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
    const CHECK: &str = "rdma";
    if ports.is_empty() {
        // Soft-RoCE goes on a real NIC: one with a device behind it, else any that is up.
        let up = up_interfaces(host);
        let netdev = up
            .iter()
            .find(|n| host.exists(&format!("/sys/class/net/{n}/device")))
            .or(up.first())
            .map_or("ETH", String::as_str);
        let release = host.read("/proc/sys/kernel/osrelease").unwrap_or_default();
        let modules = format!("/lib/modules/{release}");
        let rxe = if host.exists("/sys/module/rdma_rxe") {
            "rdma_rxe is loaded".to_owned()
        } else if host
            .list(&format!("{modules}/kernel/drivers/infiniband/sw/rxe"))
            .iter()
            .any(|f| f.starts_with("rdma_rxe"))
        {
            "this kernel ships rdma_rxe".to_owned()
        } else if !host.exists(&modules) {
            format!("no {modules}, so no rdma_rxe module to load")
        } else {
            "this kernel ships no rdma_rxe module (Ubuntu: linux-modules-extra-$(uname -r))"
                .to_owned()
        };
        return vec![
            Finding::new(
                CHECK,
                Status::Absent,
                format!("no RDMA device in /sys/class/infiniband: rdma:// cannot run here; {rxe}"),
            )
            .fix(format!(
                "for testing on Ethernet (Soft-RoCE, not fast):\n\
                 sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev {netdev}"
            )),
        ];
    }
    ports.iter().map(judge_port).collect()
}

fn judge_port(p: &RdmaPort) -> Finding {
    const CHECK: &str = "rdma";
    let roce = p.link_layer == "Ethernet";
    let mut found = format!(
        "{} port {}: {} ({}), {}",
        p.device,
        p.port,
        p.state,
        p.phys_state,
        if roce {
            "Ethernet (RoCE)"
        } else {
            &p.link_layer
        }
    );
    let active_mtu = p.netdev_mtu.and_then(roce_active_mtu);
    if roce {
        match (&p.netdev, p.netdev_mtu) {
            (Some(n), Some(m)) => {
                let mtu = active_mtu.map_or_else(|| "none".to_owned(), |a| a.to_string());
                let _ = write!(found, " on {n}, active MTU {mtu} (from {n}'s MTU {m})");
            }
            (Some(n), None) => {
                let _ = write!(found, " on {n}");
            }
            _ => found.push_str(", no Ethernet device found"),
        }
    } else {
        found.push_str(" (active MTU: `ibv_devinfo` shows it; sysfs does not)");
    }
    if let Some(rate) = &p.rate {
        let _ = write!(found, ", {rate}");
    }
    match p.numa {
        Some(n) => {
            let _ = write!(found, ", NUMA node {n}");
        }
        None => found.push_str(", no NUMA node reported"),
    }
    let roce_v2: Vec<_> = p
        .gids
        .iter()
        .filter(|(_, _, t)| t.as_deref().is_some_and(|t| t.contains("v2")))
        .collect();
    let shown: Vec<_> = if roce {
        roce_v2.clone()
    } else {
        p.gids.iter().collect()
    };
    let listed: Vec<String> = shown
        .iter()
        .take(4)
        .map(|(i, a, _)| format!("{i}={a}"))
        .collect();
    if !listed.is_empty() {
        let what = if roce { "RoCE v2 GIDs" } else { "GIDs" };
        let _ = write!(found, "; {what} {}", listed.join(" "));
    }
    let netdev = p.netdev.as_deref().unwrap_or("ETH");

    if p.state != "ACTIVE" {
        let fix = if p.phys_state != "LinkUp" {
            if roce {
                format!(
                    "no link: check the cable and switch port, and \
                     `sudo ip link set dev {netdev} up`"
                )
            } else {
                "no link: check the cable and switch port".to_owned()
            }
        } else if p.state == "INIT" && !roce {
            "no subnet manager has configured the port: sudo systemctl start opensm \
             (or enable the SM on the switch)"
                .to_owned()
        } else {
            format!("bring the port up: sudo ip link set dev {netdev} up")
        };
        return Finding::new(CHECK, Status::Warn, found).fix(fix);
    }
    if roce {
        if roce_v2.is_empty() {
            return Finding::new(
                CHECK,
                Status::Warn,
                format!("{found}; no RoCE v2 GID, so no routable RoCE address"),
            )
            .fix(format!(
                "RoCE v2 GIDs come from {netdev}'s IP addresses: \
                 sudo ip addr add ADDR/LEN dev {netdev}"
            ));
        }
        if active_mtu.is_some_and(|m| m < 4096) {
            return Finding::new(CHECK, Status::Warn, found).fix(format!(
                "sudo ip link set dev {netdev} mtu 9000    \
                 (RoCE gets 4096 from ≥ 4192; the switch ports must carry it too)"
            ));
        }
    }
    Finding::new(CHECK, Status::Ok, found)
}

fn check_uverbs(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
    const CHECK: &str = "uverbs";
    let nodes: Vec<String> = host
        .list("/dev/infiniband")
        .into_iter()
        .filter(|n| n.starts_with("uverbs"))
        .collect();
    if nodes.is_empty() {
        return vec![if ports.is_empty() {
            Finding::new(
                CHECK,
                Status::Absent,
                "no /dev/infiniband/uverbs* (no RDMA device)",
            )
        } else {
            Finding::new(
                CHECK,
                Status::Warn,
                "RDMA devices but no /dev/infiniband/uverbs*: user space cannot reach them",
            )
            .fix(
                "sudo modprobe ib_uverbs\n\
                 in a container: docker run --device=/dev/infiniband/uverbs0 (one per device) \
                 --cap-add=IPC_LOCK",
            )
        }];
    }
    nodes
        .iter()
        .map(|node| {
            let ibdev = host
                .read(&format!("/sys/class/infiniband_verbs/{node}/ibdev"))
                .unwrap_or_else(|| "?".to_owned());
            let path = host.path(&format!("/dev/infiniband/{node}"));
            // Opening is what libibverbs does first; it is refused by mode or by a
            // container's device cgroup.
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
            {
                Ok(_) => Finding::new(
                    CHECK,
                    Status::Ok,
                    format!("/dev/infiniband/{node} ({ibdev}) opens for reading and writing"),
                ),
                Err(e) => Finding::new(
                    CHECK,
                    Status::Warn,
                    format!("/dev/infiniband/{node} ({ibdev}) cannot be opened: {e:#}"),
                )
                .fix(format!(
                    "sudo chmod 666 /dev/infiniband/{node}    (until reboot)\n\
                     for good, a udev rule: KERNEL==\"uverbs*\", MODE=\"0666\" in \
                     /etc/udev/rules.d/90-rdma.rules\n\
                     in a container: --device=/dev/infiniband/{node}"
                )),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// NVIDIA GPUs and CUDA

/// An NVIDIA display or 3D controller on the PCI bus.
#[derive(Debug)]
struct Gpu {
    address: String,
    model: Option<String>,
    numa: Option<u32>,
    link_speed: Option<String>,
    link_width: Option<u32>,
    max_link_width: Option<u32>,
}

fn nvidia_gpus(host: &Host) -> Vec<Gpu> {
    host.list("/sys/bus/pci/devices")
        .into_iter()
        .filter_map(|address| {
            let dir = format!("/sys/bus/pci/devices/{address}");
            let vendor = host.read(&format!("{dir}/vendor"))?;
            let class = host.read(&format!("{dir}/class"))?;
            if !vendor.eq_ignore_ascii_case("0x10de") || !class.starts_with("0x03") {
                return None;
            }
            let model = host
                .read(&format!("/proc/driver/nvidia/gpus/{address}/information"))
                .and_then(|info| {
                    info.lines()
                        .find_map(|l| l.strip_prefix("Model:"))
                        .map(|m| m.trim().to_owned())
                });
            Some(Gpu {
                numa: numa_node(host, &format!("{dir}/numa_node")),
                link_speed: host.read(&format!("{dir}/current_link_speed")),
                link_width: host.read_num(&format!("{dir}/current_link_width")),
                max_link_width: host.read_num(&format!("{dir}/max_link_width")),
                model,
                address,
            })
        })
        .collect()
}

/// From `/proc/driver/nvidia/version`: the version (`550.54.15`) and whether it is the open
/// kernel module.
fn nvidia_driver(version_file: &str) -> Option<(String, bool)> {
    let first = version_file.lines().next()?;
    let version = first.split_whitespace().find(|w| {
        w.contains('.')
            && w.split('.')
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    })?;
    Some((version.to_owned(), first.contains("Open Kernel Module")))
}

/// Where `libcuda.so.1` is: the usual library directories, `LD_LIBRARY_PATH`, then the
/// `ld.so` cache.
fn find_libcuda(host: &Host, env: &Env) -> Option<String> {
    const DIRS: [&str; 8] = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/compat",
        "/usr/local/nvidia/lib64",
        "/usr/lib/wsl/lib",
    ];
    let extra = env.ld_library_path.iter().flat_map(|p| p.split(':'));
    for dir in DIRS.into_iter().chain(extra).filter(|d| !d.is_empty()) {
        let file = format!("{}/libcuda.so.1", dir.trim_end_matches('/'));
        if host.path(&file).exists() {
            return Some(file);
        }
    }
    let cache = std::fs::read(host.path("/etc/ld.so.cache")).ok()?;
    cache
        .windows(b"libcuda.so.1".len())
        .any(|w| w == b"libcuda.so.1")
        .then(|| "the ld.so cache".to_owned())
}

fn check_cuda(host: &Host, gpus: &[Gpu], env: &Env) -> Finding {
    const CHECK: &str = "cuda";
    let driver = host
        .read("/proc/driver/nvidia/version")
        .as_deref()
        .and_then(nvidia_driver);
    let libcuda = find_libcuda(host, env);
    let ctl = host.exists("/dev/nvidiactl");
    let gpu_count = match gpus.len() {
        1 => "1 NVIDIA GPU".to_owned(),
        n => format!("{n} NVIDIA GPUs"),
    };
    match (&driver, &libcuda) {
        (None, lib) if !gpus.is_empty() => Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "{gpu_count} but no NVIDIA kernel driver (/proc/driver/nvidia/version){}",
                lib.as_ref()
                    .map(|l| format!("; libcuda.so.1 in {l}"))
                    .unwrap_or_default()
            ),
        )
        .fix(
            "install the NVIDIA driver; the open kernel modules also give dma-buf \
             (Ubuntu: sudo ubuntu-drivers install --gpgpu, \
             or sudo apt install nvidia-driver-570-server-open)",
        ),
        (None, Some(lib)) => Finding::new(
            CHECK,
            Status::Info,
            format!("libcuda.so.1 in {lib}, but no NVIDIA driver or GPU is visible"),
        )
        .fix("in a container: docker run --gpus all (NVIDIA Container Toolkit)"),
        (Some((version, open)), lib) => {
            let kind = if *open {
                "open kernel module"
            } else {
                "proprietary kernel module"
            };
            let mut found = format!("NVIDIA driver {version} ({kind}), {gpu_count}");
            match lib {
                Some(l) => {
                    let _ = write!(found, ", libcuda.so.1 in {l}");
                }
                None => found.push_str(", no libcuda.so.1"),
            }
            if !ctl {
                found.push_str(", no /dev/nvidiactl");
                return Finding::new(CHECK, Status::Warn, found).fix(
                    "sudo nvidia-modprobe -u -c=0    (creates the device files)\n\
                     in a container: docker run --gpus all",
                );
            }
            if lib.is_none() {
                let major = version.split('.').next().unwrap_or("VERSION");
                return Finding::new(CHECK, Status::Warn, found).fix(format!(
                    "install the driver's user-space libraries \
                     (Ubuntu: sudo apt install libnvidia-compute-{major}; \
                     RHEL: nvidia-driver-cuda-libs)"
                ));
            }
            Finding::new(CHECK, Status::Ok, found)
        }
        (None, None) => Finding::new(
            CHECK,
            Status::Absent,
            "no NVIDIA GPU on the PCI bus, no NVIDIA driver, no libcuda.so.1: device bodies \
             (feature `cuda`) cannot run here",
        ),
    }
}

/// What hyperframes itself gets from the CUDA driver (the entry point device bodies use):
/// `None` in a build of hf without feature `cuda`.
fn probe_cuda() -> Option<Result<usize, String>> {
    #[cfg(feature = "cuda")]
    {
        Some(hyperframes::device::cuda_device_count().map_err(|e| e.to_string()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

fn check_cuda_driver(probe: Option<Result<usize, String>>) -> Finding {
    const CHECK: &str = "cuda_driver";
    match probe {
        None => Finding::new(
            CHECK,
            Status::Info,
            "device bodies are not in this build of hf (feature `cuda`): not probed",
        )
        .fix("cargo install hyperframes-cli --features cuda"),
        Some(Ok(0)) => Finding::new(
            CHECK,
            Status::Absent,
            "hyperframes started the CUDA driver, which reports no device",
        ),
        Some(Ok(n)) => Finding::new(
            CHECK,
            Status::Ok,
            format!("hyperframes started the CUDA driver: {n} device(s) for device bodies"),
        ),
        Some(Err(e)) => {
            let e = e.replace(" (run `hf doctor` to check this host)", "");
            Finding::new(CHECK, Status::Absent, format!("hyperframes: {e}"))
        }
    }
}

fn check_gpus(gpus: &[Gpu]) -> Vec<Finding> {
    const CHECK: &str = "gpu";
    if gpus.is_empty() {
        return vec![Finding::new(
            CHECK,
            Status::Absent,
            "no NVIDIA GPU (PCI vendor 0x10de, display class) in /sys/bus/pci/devices",
        )];
    }
    gpus.iter()
        .map(|g| {
            let mut found = format!(
                "{} {}",
                g.address,
                g.model
                    .as_deref()
                    .unwrap_or("(model unknown: driver not loaded)")
            );
            match g.numa {
                Some(n) => {
                    let _ = write!(found, ", NUMA node {n}");
                }
                None => found.push_str(", no NUMA node reported"),
            }
            if let (Some(speed), Some(width)) = (&g.link_speed, g.link_width) {
                let _ = write!(found, ", PCIe {speed} x{width}");
                if let Some(max) = g.max_link_width {
                    let _ = write!(found, " (card max x{max})");
                }
            }
            match (g.link_width, g.max_link_width) {
                (Some(w), Some(max)) if w < max => Finding::new(
                    CHECK,
                    Status::Warn,
                    format!("{found}: the link trained narrower than the card"),
                )
                .fix(
                    "check the slot's wiring and the BIOS PCIe bifurcation, or reseat the card \
                     (speed may drop at idle; width should not)",
                ),
                _ => Finding::new(CHECK, Status::Ok, found),
            }
        })
        .collect()
}

fn check_gpudirect(host: &Host, gpus: &[Gpu], rdma: bool) -> Finding {
    const CHECK: &str = "gpudirect";
    if gpus.is_empty() {
        return Finding::new(CHECK, Status::Absent, "no NVIDIA GPU, so no GPUDirect RDMA");
    }
    let peermem = ["nvidia_peermem", "nv_peer_mem"]
        .into_iter()
        .find(|m| host.exists(&format!("/sys/module/{m}")));
    let release = host.read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let kernel = kernel_version(&release);
    let driver = host
        .read("/proc/driver/nvidia/version")
        .as_deref()
        .and_then(nvidia_driver);
    let major: Option<u32> = driver
        .as_ref()
        .and_then(|(v, _)| v.split('.').next()?.parse().ok());
    // dma-buf export of GPU memory: Linux 5.12+, and the open kernel modules from R515 on.
    let dmabuf = kernel.is_some_and(|k| k >= (5, 12))
        && driver.as_ref().is_some_and(|(_, open)| *open)
        && major.is_some_and(|m| m >= 515);
    let found = format!(
        "peer memory module: {}; dma-buf: {} (Linux {release}, needs ≥ 5.12; driver {}, \
         needs the open kernel module ≥ 515)",
        peermem.map_or_else(|| "not loaded".to_owned(), |m| format!("{m} loaded")),
        if dmabuf { "yes" } else { "no" },
        match &driver {
            Some((v, true)) => format!("{v} open"),
            Some((v, false)) => format!("{v} proprietary"),
            None => "not loaded".to_owned(),
        }
    );
    if peermem.is_some() || dmabuf {
        Finding::new(CHECK, Status::Ok, found)
    } else if !rdma {
        Finding::new(
            CHECK,
            Status::Info,
            format!("{found}; no RDMA device either, so nothing to do"),
        )
    } else {
        Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "{found}: GPU memory cannot be registered with the NIC, \
                 bodies go through host memory"
            ),
        )
        .fix(
            "sudo modprobe nvidia_peermem    \
             (ships with the driver; needs it built against the running ib_core)\n\
             or the open kernel modules (R515+) on Linux ≥ 5.12 for dma-buf",
        )
    }
}

// ---------------------------------------------------------------------------------------------
// NUMA

fn check_numa(host: &Host, ports: &[RdmaPort], gpus: &[Gpu]) -> Finding {
    const CHECK: &str = "numa";
    let nodes: Vec<String> = host
        .list("/sys/devices/system/node")
        .into_iter()
        .filter(|n| {
            n.strip_prefix("node")
                .is_some_and(|d| d.parse::<u32>().is_ok())
        })
        .collect();
    let describe = |n: &String| {
        let cpus = host
            .read(&format!("/sys/devices/system/node/{n}/cpulist"))
            .unwrap_or_else(|| "?".to_owned());
        format!("{n} (CPUs {cpus})")
    };
    // Devices and their nodes: physical NICs, RDMA devices, GPUs.
    let mut placed: Vec<(String, Option<u32>)> = Vec::new();
    for nic in up_interfaces(host) {
        if host.exists(&format!("/sys/class/net/{nic}/device")) {
            placed.push((
                nic.clone(),
                numa_node(host, &format!("/sys/class/net/{nic}/device/numa_node")),
            ));
        }
    }
    let mut rdma_nodes = Vec::new();
    for p in ports {
        if !placed.iter().any(|(d, _)| *d == p.device) {
            placed.push((p.device.clone(), p.numa));
            rdma_nodes.extend(p.numa);
        }
    }
    for g in gpus {
        placed.push((format!("GPU {}", g.address), g.numa));
    }
    let placement = placed
        .iter()
        .map(|(d, n)| match n {
            Some(n) => format!("{d} on node {n}"),
            None => format!("{d} with no node reported"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    match nodes.len() {
        0 => Finding::new(
            CHECK,
            Status::Info,
            "no NUMA information in /sys/devices/system/node",
        ),
        1 => Finding::new(
            CHECK,
            Status::Ok,
            format!(
                "1 node, {}: every NIC and GPU is local",
                describe(&nodes[0])
            ),
        ),
        n => {
            let found = format!(
                "{n} nodes, {}; {}",
                nodes.iter().map(describe).collect::<Vec<_>>().join(", "),
                if placement.is_empty() {
                    "no NIC or GPU reports a node".to_owned()
                } else {
                    placement
                }
            );
            let gpu_nodes: Vec<u32> = gpus.iter().filter_map(|g| g.numa).collect();
            if !gpu_nodes.is_empty()
                && !rdma_nodes.is_empty()
                && !gpu_nodes.iter().any(|g| rdma_nodes.contains(g))
            {
                return Finding::new(
                    CHECK,
                    Status::Warn,
                    format!(
                        "{found}: no GPU shares a node with an RDMA NIC, \
                         so GPUDirect traffic crosses the inter-socket link"
                    ),
                )
                .fix("move a GPU or the NIC into slots under one node (see `nvidia-smi topo -m`)");
            }
            let node = rdma_nodes
                .first()
                .copied()
                .or_else(|| placed.iter().find_map(|(_, n)| *n))
                .map_or_else(|| "N".to_owned(), |n| n.to_string());
            Finding::new(CHECK, Status::Info, found).fix(format!(
                "run each process on the node of the NIC (and GPU) it uses:\n\
                 numactl --cpunodebind={node} --membind={node} COMMAND"
            ))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Interfaces

/// Non-loopback interfaces that are administratively up and not down, in natural order.
fn up_interfaces(host: &Host) -> Vec<String> {
    host.list("/sys/class/net")
        .into_iter()
        .filter(|n| {
            let dir = format!("/sys/class/net/{n}");
            let is_loopback = host.read_num::<u32>(&format!("{dir}/type")) == Some(772);
            let flags = host
                .read(&format!("{dir}/flags"))
                .and_then(|f| u32::from_str_radix(f.trim_start_matches("0x"), 16).ok())
                .unwrap_or(0);
            let oper = host.read(&format!("{dir}/operstate")).unwrap_or_default();
            !is_loopback && n != "lo" && flags & 1 != 0 && (oper == "up" || oper == "unknown")
        })
        .collect()
}

fn check_mtu(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
    const CHECK: &str = "mtu";
    let ifaces = up_interfaces(host);
    if ifaces.is_empty() {
        return vec![Finding::new(
            CHECK,
            Status::Info,
            "no network interface is up besides loopback",
        )];
    }
    ifaces
        .iter()
        .map(|n| {
            let Some(mtu) = host.read_num::<u32>(&format!("/sys/class/net/{n}/mtu")) else {
                return Finding::new(CHECK, Status::Error, format!("{n}: cannot read its MTU"));
            };
            let virt = if host.exists(&format!("/sys/class/net/{n}/device")) {
                ""
            } else {
                ", virtual"
            };
            let roce = ports
                .iter()
                .any(|p| p.netdev.as_deref() == Some(n.as_str()));
            let fix = format!(
                "sudo ip link set dev {n} mtu 9000    (every hop on the path must carry it)"
            );
            if mtu >= 9000 {
                Finding::new(
                    CHECK,
                    Status::Ok,
                    format!("{n}: {mtu} (jumbo frames{virt})"),
                )
            } else if roce {
                Finding::new(
                    CHECK,
                    Status::Warn,
                    format!(
                        "{n}: {mtu}, under a RoCE port: RDMA messages are cut into smaller \
                         packets (9000 recommended)"
                    ),
                )
                .fix(fix)
            } else {
                Finding::new(
                    CHECK,
                    Status::Info,
                    format!(
                        "{n}: {mtu}{virt}; jumbo frames (9000) cut per-packet cost \
                         on datacenter links"
                    ),
                )
                .fix(fix)
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// CPU and memory

fn check_governor(host: &Host) -> Finding {
    const CHECK: &str = "cpu_governor";
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut cpus = 0;
    for cpu in host.list("/sys/devices/system/cpu") {
        let numbered = cpu.strip_prefix("cpu").and_then(|d| d.parse::<u32>().ok());
        if numbered.is_none() {
            continue;
        }
        cpus += 1;
        if let Some(g) = host.read(&format!(
            "/sys/devices/system/cpu/{cpu}/cpufreq/scaling_governor"
        )) {
            match counts.iter_mut().find(|(name, _)| *name == g) {
                Some((_, n)) => *n += 1,
                None => counts.push((g, 1)),
            }
        }
    }
    if counts.is_empty() {
        return Finding::new(
            CHECK,
            Status::Info,
            format!(
                "no cpufreq governor for {cpus} CPUs: the frequency is managed by the \
                 hypervisor or firmware (usual on VMs)"
            ),
        );
    }
    let summary = counts
        .iter()
        .map(|(g, n)| format!("{g} on {n} CPU{}", if *n == 1 { "" } else { "s" }))
        .collect::<Vec<_>>()
        .join(", ");
    if counts.iter().all(|(g, _)| g == "performance") {
        Finding::new(CHECK, Status::Ok, summary)
    } else {
        Finding::new(
            CHECK,
            Status::Warn,
            format!("{summary}: clocks ramp up after load arrives, adding latency and jitter"),
        )
        .fix(
            "echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor\n\
             or: sudo cpupower frequency-set -g performance",
        )
    }
}

/// `"always [madvise] never"` → `"madvise"`.
fn bracketed(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

fn check_thp(host: &Host) -> Finding {
    const CHECK: &str = "thp";
    let Some(enabled) = host.read("/sys/kernel/mm/transparent_hugepage/enabled") else {
        return Finding::new(
            CHECK,
            Status::Absent,
            "no /sys/kernel/mm/transparent_hugepage (kernel without THP)",
        );
    };
    let Some(mode) = bracketed(&enabled) else {
        return Finding::new(
            CHECK,
            Status::Error,
            format!("cannot read the mode in {enabled:?}"),
        );
    };
    let shmem = host
        .read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .and_then(|s| bracketed(&s).map(|m| format!("; shmem (memfd segments): {m}")))
        .unwrap_or_default();
    let fix = "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled";
    match mode {
        "madvise" => Finding::new(
            CHECK,
            Status::Ok,
            format!("transparent huge pages: madvise (for programs that ask){shmem}"),
        ),
        "always" => Finding::new(
            CHECK,
            Status::Info,
            format!(
                "transparent huge pages: always{shmem}; good for bandwidth, but compaction can \
                 add latency spikes: latency-sensitive hosts usually choose madvise"
            ),
        )
        .fix(fix),
        other => Finding::new(
            CHECK,
            Status::Info,
            format!(
                "transparent huge pages: {other}{shmem}; large buffers take more TLB misses \
                 and more NIC translation entries"
            ),
        )
        .fix(fix),
    }
}

fn check_hugepages(meminfo: Option<&str>) -> Finding {
    const CHECK: &str = "hugepages";
    let Some(meminfo) = meminfo else {
        return Finding::new(CHECK, Status::Error, "cannot read /proc/meminfo");
    };
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    match (
        field("HugePages_Total"),
        field("HugePages_Free"),
        field("Hugepagesize"),
    ) {
        (Some(total), Some(free), Some(size_kb)) => Finding::new(
            CHECK,
            Status::Info,
            format!(
                "{total} reserved, {free} free, {} each (vm.nr_hugepages); hyperframes does \
                 not use hugetlbfs pages itself",
                human_bytes(size_kb * 1024)
            ),
        ),
        _ => Finding::new(
            CHECK,
            Status::Absent,
            "no HugePages_* lines in /proc/meminfo (kernel without hugetlbfs)",
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Socket buffers

/// Recommended ceiling for socket buffers on 100 Gb/s links: 64 MiB.
const BUFFER_GOAL: u64 = 64 << 20;

fn check_core_buffer(name: &'static str, value: Option<&str>) -> Finding {
    let Some(bytes) = value.and_then(|v| v.parse::<u64>().ok()) else {
        return Finding::new(
            name,
            Status::Error,
            format!("cannot read {}", sysctl_path(name)),
        );
    };
    let found = format!(
        "{bytes} ({}): the most a program may ask for with {}",
        approx_bytes(bytes),
        if name.contains("rmem") {
            "SO_RCVBUF"
        } else {
            "SO_SNDBUF"
        }
    );
    if bytes >= BUFFER_GOAL {
        Finding::new(name, Status::Ok, found)
    } else {
        Finding::new(
            name,
            Status::Warn,
            format!("{found}; under 64 MiB, which 100 Gb/s links with any latency need"),
        )
        .fix(format!(
            "sudo sysctl -w {name}={BUFFER_GOAL}\n\
             to keep it: echo '{name} = {BUFFER_GOAL}' \
             | sudo tee -a /etc/sysctl.d/90-hyperframes.conf"
        ))
    }
}

fn check_tcp_buffer(name: &'static str, value: Option<&str>) -> Finding {
    let numbers: Vec<u64> = value
        .map(|v| {
            v.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let [min, default, max] = numbers[..] else {
        return Finding::new(
            name,
            Status::Error,
            format!("cannot read three numbers from {}", sysctl_path(name)),
        );
    };
    let found = format!(
        "min {}, default {}, max {}: tcp:// leaves buffer sizes to the kernel's autotuning, \
         which grows them up to max",
        human_bytes(min),
        human_bytes(default),
        human_bytes(max)
    );
    if max >= BUFFER_GOAL {
        Finding::new(name, Status::Ok, found)
    } else {
        Finding::new(name, Status::Warn, format!("{found}; under 64 MiB")).fix(format!(
            "sudo sysctl -w {name}=\"{min} {default} {BUFFER_GOAL}\"\n\
                 to keep it: echo '{name} = {min} {default} {BUFFER_GOAL}' \
                 | sudo tee -a /etc/sysctl.d/90-hyperframes.conf"
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Shared memory

/// The effective user id, from `Uid:` in `/proc/self/status`.
fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The directory `shm://NAME` sockets go in, as the library chooses it.
fn shm_dir(host: &Host, env: &Env) -> String {
    match &env.xdg_runtime_dir {
        Some(d) if host.path(d).is_dir() => format!("{}/hyperframes", d.trim_end_matches('/')),
        _ => {
            let uid = host
                .read("/proc/self/status")
                .as_deref()
                .and_then(effective_uid)
                .map_or_else(|| "UID".to_owned(), |u| u.to_string());
            format!("/tmp/hyperframes-{uid}")
        }
    }
}

fn check_shm(host: &Host, env: &Env, probe: Probe) -> Finding {
    const CHECK: &str = "shm";
    let dir = shm_dir(host, env);
    match probe {
        Probe::Worked(_) => Finding::new(
            CHECK,
            Status::Ok,
            format!("shm:// works: a loopback connection through {dir} carried a message"),
        ),
        Probe::NotBuilt => Finding::new(
            CHECK,
            Status::Info,
            "shm:// is not in this build (feature `shm`)",
        )
        .fix("cargo install hyperframes --features shm"),
        Probe::Failed(e) => {
            let fix = if e.contains("private directory") {
                format!(
                    "chmod 700 {dir}    (if it is yours; else remove it)\n\
                     or name the socket yourself: shm:///ABSOLUTE/PATH.sock"
                )
            } else {
                "name the socket yourself (shm:///ABSOLUTE/PATH.sock); in a container, memfd_create \
                 and eventfd must be allowed by its seccomp profile"
                    .to_owned()
            };
            Finding::new(
                CHECK,
                Status::Warn,
                format!("shm:// loopback through {dir} failed: {e:#}"),
            )
            .fix(fix)
        }
    }
}

fn check_dev_shm(host: &Host) -> Finding {
    const CHECK: &str = "dev_shm";
    let path = host.path("/dev/shm");
    if !path.is_dir() {
        return Finding::new(
            CHECK,
            Status::Absent,
            "no /dev/shm; shm:// does not need it (memfds)",
        );
    }
    let note = "shm:// maps memfds, which this size does not limit; libraries that use /dev/shm \
                (NCCL, UCX posix, iceoryx2) are limited by it";
    match dev_shm_space(&path) {
        Some((size, free)) if size < 1 << 30 => Finding::new(
            CHECK,
            Status::Info,
            format!(
                "/dev/shm: {} ({} free) is small; {note}",
                approx_bytes(size),
                approx_bytes(free)
            ),
        )
        .fix(
            "sudo mount -o remount,size=8G /dev/shm    (in a container: docker run --shm-size=8g)",
        ),
        Some((size, free)) => Finding::new(
            CHECK,
            Status::Ok,
            format!(
                "/dev/shm: {} ({} free); {note}",
                approx_bytes(size),
                approx_bytes(free)
            ),
        ),
        None => Finding::new(
            CHECK,
            Status::Info,
            format!("/dev/shm present (size not measured in this build); {note}"),
        ),
    }
}

/// Size and free bytes of the file system at `path`.
#[cfg(feature = "shm")]
fn dev_shm_space(path: &Path) -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(path).ok()?;
    Some((st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize))
}

#[cfg(not(feature = "shm"))]
fn dev_shm_space(_path: &Path) -> Option<(u64, u64)> {
    None
}

/// `n` bytes to one decimal in the largest binary unit: `25.1 GiB`.
fn approx_bytes(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift {
            return format!("{:.1} {unit}", n as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{n} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fake root file system in a temporary directory, removed when dropped.
    struct Fake {
        root: PathBuf,
    }

    impl Fake {
        fn new() -> Fake {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let root = std::env::temp_dir().join(format!(
                "hf-doctor-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Fake { root }
        }

        /// Writes `contents` and a newline at `path` (absolute, as on a real host).
        fn file(&self, path: &str, contents: &str) -> &Fake {
            let p = self.root.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{contents}\n")).unwrap();
            self
        }

        fn dir(&self, path: &str) -> &Fake {
            std::fs::create_dir_all(self.root.join(path.trim_start_matches('/'))).unwrap();
            self
        }

        fn host(&self) -> Host {
            Host::at(&self.root)
        }

        /// An interface that is up, with a PCI device behind it unless `virtual_`.
        fn netdev(&self, name: &str, mtu: u32, numa: i32) -> &Fake {
            let dir = format!("/sys/class/net/{name}");
            self.file(&format!("{dir}/mtu"), &mtu.to_string())
                .file(&format!("{dir}/flags"), "0x1003")
                .file(&format!("{dir}/operstate"), "up")
                .file(&format!("{dir}/type"), "1")
                .file(&format!("{dir}/device/numa_node"), &numa.to_string())
        }

        /// `mlx5_0` port 1 over RoCE on `eth2`, with a link-local RoCE v1 GID, an
        /// IPv4-mapped RoCE v2 GID and an unused one.
        fn roce(&self, state: &str, phys: &str) -> &Fake {
            let port = "/sys/class/infiniband/mlx5_0/ports/1";
            self.file(&format!("{port}/state"), state)
                .file(&format!("{port}/phys_state"), phys)
                .file(&format!("{port}/link_layer"), "Ethernet")
                .file(&format!("{port}/rate"), "100 Gb/sec (4X EDR)")
                .file(
                    &format!("{port}/gids/0"),
                    "fe80:0000:0000:0000:0ed5:fdff:fe12:3456",
                )
                .file(
                    &format!("{port}/gids/1"),
                    "0000:0000:0000:0000:0000:ffff:0a00:0001",
                )
                .file(
                    &format!("{port}/gids/2"),
                    "0000:0000:0000:0000:0000:0000:0000:0000",
                )
                .file(&format!("{port}/gid_attrs/types/0"), "IB/RoCE v1")
                .file(&format!("{port}/gid_attrs/types/1"), "RoCE v2")
                .file(&format!("{port}/gid_attrs/ndevs/0"), "eth2")
                .file(&format!("{port}/gid_attrs/ndevs/1"), "eth2")
                .file("/sys/class/infiniband/mlx5_0/device/numa_node", "1")
        }

        /// An NVIDIA GPU at `addr` on `numa`, its link `width` of 16 lanes.
        fn gpu(&self, addr: &str, numa: i32, width: u32) -> &Fake {
            let dir = format!("/sys/bus/pci/devices/{addr}");
            self.file(&format!("{dir}/vendor"), "0x10de")
                .file(&format!("{dir}/class"), "0x030200")
                .file(&format!("{dir}/numa_node"), &numa.to_string())
                .file(&format!("{dir}/current_link_speed"), "32.0 GT/s PCIe")
                .file(&format!("{dir}/current_link_width"), &width.to_string())
                .file(&format!("{dir}/max_link_width"), "16")
                .file(
                    &format!("/proc/driver/nvidia/gpus/{addr}/information"),
                    "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 123",
                )
        }

        fn nvidia_driver(&self, open: bool) -> &Fake {
            let kind = if open {
                "NVIDIA UNIX Open Kernel Module for x86_64"
            } else {
                "NVIDIA UNIX x86_64 Kernel Module"
            };
            self.file(
                "/proc/driver/nvidia/version",
                &format!("NVRM version: {kind}  550.54.15  Release Build\nGCC version: gcc 12"),
            )
            .file("/dev/nvidiactl", "")
            .file("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "")
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    fn one(findings: Vec<Finding>) -> Finding {
        assert_eq!(findings.len(), 1, "{findings:#?}");
        findings.into_iter().next().unwrap()
    }

    fn assert_has(f: &Finding, status: Status, found: &[&str], fix: &[&str]) {
        assert_eq!(f.status, status, "{f:#?}");
        for needle in found {
            assert!(f.found.contains(needle), "found lacks {needle:?}: {f:#?}");
        }
        for needle in fix {
            let text = f.fix.as_deref().unwrap_or_default();
            assert!(text.contains(needle), "fix lacks {needle:?}: {f:#?}");
        }
    }

    #[test]
    fn roce_port_with_jumbo_frames_is_ok() {
        let fake = Fake::new();
        fake.roce("4: ACTIVE", "5: LinkUp").netdev("eth2", 9000, 1);
        let host = fake.host();
        let ports = rdma_ports(&host);
        let f = one(check_rdma(&host, &ports));
        assert_has(
            &f,
            Status::Ok,
            &[
                "mlx5_0 port 1: ACTIVE (LinkUp)",
                "Ethernet (RoCE) on eth2",
                "active MTU 4096",
                "100 Gb/sec",
                "NUMA node 1",
                "RoCE v2 GIDs 1=::ffff:10.0.0.1",
            ],
            &[],
        );
        assert!(
            !f.found.contains("fe80"),
            "only RoCE v2 GIDs are listed: {f:#?}"
        );
        assert_eq!(f.fix, None);
        let mtu = one(check_mtu(&host, &ports));
        assert_has(&mtu, Status::Ok, &["eth2: 9000"], &[]);
    }

    #[test]
    fn roce_port_on_standard_frames_warns() {
        let fake = Fake::new();
        fake.roce("4: ACTIVE", "5: LinkUp").netdev("eth2", 1500, 1);
        let host = fake.host();
        let ports = rdma_ports(&host);
        let f = one(check_rdma(&host, &ports));
        assert_has(
            &f,
            Status::Warn,
            &["active MTU 1024 (from eth2's MTU 1500)"],
            &["sudo ip link set dev eth2 mtu 9000"],
        );
        // The interface under the port is a warning too; elsewhere 1500 is only info.
        let mtu = one(check_mtu(&host, &ports));
        assert_has(&mtu, Status::Warn, &["eth2: 1500", "RoCE"], &["mtu 9000"]);
        let plain = Fake::new();
        plain.netdev("eth0", 1500, -1);
        let mtu = one(check_mtu(&plain.host(), &[]));
        assert_has(
            &mtu,
            Status::Info,
            &["eth0: 1500"],
            &["sudo ip link set dev eth0 mtu 9000"],
        );
    }

    #[test]
    fn roce_active_mtu_follows_the_kernel() {
        assert_eq!(roce_active_mtu(9000), Some(4096));
        assert_eq!(roce_active_mtu(4192), Some(4096));
        assert_eq!(roce_active_mtu(4191), Some(2048));
        assert_eq!(roce_active_mtu(1500), Some(1024));
        assert_eq!(roce_active_mtu(300), None);
        assert_eq!(roce_active_mtu(0), None);
    }

    #[test]
    fn port_down_or_without_address_warns() {
        let fake = Fake::new();
        fake.roce("1: DOWN", "3: Disabled").netdev("eth2", 9000, 1);
        let f = one(check_rdma(&fake.host(), &rdma_ports(&fake.host())));
        assert_has(
            &f,
            Status::Warn,
            &["DOWN (Disabled)"],
            &["sudo ip link set dev eth2 up"],
        );

        let fake = Fake::new();
        fake.roce("4: ACTIVE", "5: LinkUp")
            .netdev("eth2", 9000, 1)
            .file(
                "/sys/class/infiniband/mlx5_0/ports/1/gids/1",
                "0000:0000:0000:0000:0000:0000:0000:0000",
            );
        let f = one(check_rdma(&fake.host(), &rdma_ports(&fake.host())));
        assert_has(&f, Status::Warn, &["no RoCE v2 GID"], &["sudo ip addr add"]);

        // InfiniBand waiting for a subnet manager.
        let fake = Fake::new();
        let port = "/sys/class/infiniband/mlx5_1/ports/1";
        fake.file(&format!("{port}/state"), "2: INIT")
            .file(&format!("{port}/phys_state"), "5: LinkUp")
            .file(&format!("{port}/link_layer"), "InfiniBand");
        let f = one(check_rdma(&fake.host(), &rdma_ports(&fake.host())));
        assert_has(
            &f,
            Status::Warn,
            &["mlx5_1 port 1: INIT", "InfiniBand"],
            &["opensm"],
        );
    }

    #[test]
    fn no_rdma_device_is_a_finding() {
        let fake = Fake::new();
        fake.netdev("ens5", 1500, -1)
            .file("/sys/class/net/docker0/flags", "0x1003")
            .file("/sys/class/net/docker0/operstate", "up")
            .file("/proc/sys/kernel/osrelease", "6.8.0-45-generic")
            .file(
                "/lib/modules/6.8.0-45-generic/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.zst",
                "",
            );
        let f = one(check_rdma(&fake.host(), &[]));
        assert_has(
            &f,
            Status::Absent,
            &["no RDMA device", "this kernel ships rdma_rxe"],
            &["sudo rdma link add rxe0 type rxe netdev ens5"],
        );
        let f = one(check_uverbs(&fake.host(), &[]));
        assert_has(&f, Status::Absent, &["no /dev/infiniband/uverbs*"], &[]);
    }

    #[test]
    fn uverbs_missing_or_openable() {
        let fake = Fake::new();
        fake.roce("4: ACTIVE", "5: LinkUp").netdev("eth2", 9000, 1);
        let ports = rdma_ports(&fake.host());
        let f = one(check_uverbs(&fake.host(), &ports));
        assert_has(
            &f,
            Status::Warn,
            &["no /dev/infiniband/uverbs*"],
            &["sudo modprobe ib_uverbs"],
        );
        fake.file("/dev/infiniband/uverbs0", "")
            .file("/sys/class/infiniband_verbs/uverbs0/ibdev", "mlx5_0");
        let f = one(check_uverbs(&fake.host(), &ports));
        assert_has(&f, Status::Ok, &["/dev/infiniband/uverbs0 (mlx5_0)"], &[]);
    }

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

    #[test]
    fn socket_buffer_limits() {
        let f = check_core_buffer("net.core.rmem_max", Some("212992"));
        assert_has(
            &f,
            Status::Warn,
            &["212992 (208.0 KiB)", "SO_RCVBUF"],
            &[
                "sudo sysctl -w net.core.rmem_max=67108864",
                "/etc/sysctl.d/",
            ],
        );
        let f = check_core_buffer("net.core.wmem_max", Some("67108864"));
        assert_has(&f, Status::Ok, &["67108864 (64.0 MiB)", "SO_SNDBUF"], &[]);
        assert_eq!(f.fix, None);
        assert_eq!(
            check_core_buffer("net.core.rmem_max", Some("-1")).status,
            Status::Error
        );
        assert_eq!(
            check_core_buffer("net.core.rmem_max", None).status,
            Status::Error
        );

        let f = check_tcp_buffer("net.ipv4.tcp_rmem", Some("4096\t131072\t6291456"));
        assert_has(
            &f,
            Status::Warn,
            &["max 6 MiB"],
            &["sudo sysctl -w net.ipv4.tcp_rmem=\"4096 131072 67108864\""],
        );
        let f = check_tcp_buffer("net.ipv4.tcp_wmem", Some("4096 16384 134217728"));
        assert_has(&f, Status::Ok, &["max 128 MiB"], &[]);
        for odd in ["4096 87380", "a b c", "1 2 3 4", ""] {
            let f = check_tcp_buffer("net.ipv4.tcp_rmem", Some(odd));
            assert_eq!(f.status, Status::Error, "{odd:?}");
        }
    }

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

    #[test]
    fn cpu_governors() {
        let fake = Fake::new();
        fake.dir("/sys/devices/system/cpu/cpufreq")
            .file(
                "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
                "powersave",
            )
            .file(
                "/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor",
                "performance",
            )
            .file(
                "/sys/devices/system/cpu/cpu2/cpufreq/scaling_governor",
                "powersave",
            );
        let f = check_governor(&fake.host());
        assert_has(
            &f,
            Status::Warn,
            &["powersave on 2 CPUs", "performance on 1 CPU"],
            &["echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"],
        );
        fake.file(
            "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
            "performance",
        )
        .file(
            "/sys/devices/system/cpu/cpu2/cpufreq/scaling_governor",
            "performance",
        );
        assert_eq!(check_governor(&fake.host()).status, Status::Ok);

        let vm = Fake::new();
        vm.dir("/sys/devices/system/cpu/cpu0")
            .dir("/sys/devices/system/cpu/cpu1");
        let f = check_governor(&vm.host());
        assert_has(&f, Status::Info, &["no cpufreq governor for 2 CPUs"], &[]);
        assert_eq!(f.fix, None);
    }

    #[test]
    fn huge_pages() {
        let fake = Fake::new();
        fake.file(
            "/sys/kernel/mm/transparent_hugepage/enabled",
            "always madvise [never]",
        );
        let f = check_thp(&fake.host());
        assert_has(&f, Status::Info, &["never"], &["echo madvise | sudo tee"]);
        fake.file(
            "/sys/kernel/mm/transparent_hugepage/enabled",
            "always [madvise] never",
        )
        .file(
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
            "always within_size advise [never] deny force",
        );
        assert_has(
            &check_thp(&fake.host()),
            Status::Ok,
            &["madvise", "shmem (memfd segments): never"],
            &[],
        );
        fake.file("/sys/kernel/mm/transparent_hugepage/enabled", "[always");
        assert_eq!(check_thp(&fake.host()).status, Status::Error);
        assert_eq!(check_thp(&Fake::new().host()).status, Status::Absent);

        let meminfo = "MemTotal: 1 kB\nHugePages_Total:      16\n\
                       HugePages_Free:       8\nHugepagesize:    1048576 kB\n";
        assert_has(
            &check_hugepages(Some(meminfo)),
            Status::Info,
            &["16 reserved, 8 free, 1 GiB each"],
            &[],
        );
        assert_eq!(
            check_hugepages(Some("MemTotal: 1 kB")).status,
            Status::Absent
        );
        assert_eq!(check_hugepages(None).status, Status::Error);
    }

    #[test]
    fn gpus_driver_and_gpudirect() {
        let fake = Fake::new();
        fake.gpu("0000:3b:00.0", 0, 16)
            .gpu("0000:d8:00.0", 1, 8)
            .nvidia_driver(true)
            .file("/proc/sys/kernel/osrelease", "6.8.0-45-generic")
            .file("/sys/bus/pci/devices/0000:00:1f.0/vendor", "0x8086")
            .file("/sys/bus/pci/devices/0000:00:1f.0/class", "0x060100")
            // An NVIDIA audio function is not a GPU.
            .file("/sys/bus/pci/devices/0000:3b:00.1/vendor", "0x10de")
            .file("/sys/bus/pci/devices/0000:3b:00.1/class", "0x040300");
        let host = fake.host();
        let gpus = nvidia_gpus(&host);
        assert_eq!(gpus.len(), 2, "{gpus:#?}");
        let findings = check_gpus(&gpus);
        assert_has(
            &findings[0],
            Status::Ok,
            &[
                "0000:3b:00.0 NVIDIA H100 80GB HBM3",
                "NUMA node 0",
                "PCIe 32.0 GT/s PCIe x16",
            ],
            &[],
        );
        assert_has(
            &findings[1],
            Status::Warn,
            &["x8 (card max x16)", "narrower"],
            &["bifurcation"],
        );

        let f = check_cuda(&host, &gpus, &Env::default());
        assert_has(
            &f,
            Status::Ok,
            &[
                "NVIDIA driver 550.54.15 (open kernel module)",
                "2 NVIDIA GPUs",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            ],
            &[],
        );
        let f = check_gpudirect(&host, &gpus, true);
        assert_has(&f, Status::Ok, &["not loaded", "dma-buf: yes"], &[]);

        // Proprietary module, no peer memory module, an RDMA NIC: GPUDirect is off.
        fake.nvidia_driver(false);
        let f = check_gpudirect(&host, &gpus, true);
        assert_has(
            &f,
            Status::Warn,
            &["dma-buf: no", "proprietary"],
            &["sudo modprobe nvidia_peermem"],
        );
        assert_eq!(check_gpudirect(&host, &gpus, false).status, Status::Info);
        fake.dir("/sys/module/nvidia_peermem");
        assert_has(
            &check_gpudirect(&host, &gpus, true),
            Status::Ok,
            &["nvidia_peermem loaded"],
            &[],
        );

        // A GPU without a driver.
        let bare = Fake::new();
        bare.gpu("0000:3b:00.0", 0, 16);
        let gpus = nvidia_gpus(&bare.host());
        assert_has(
            &check_cuda(&bare.host(), &gpus, &Env::default()),
            Status::Warn,
            &["1 NVIDIA GPU but no NVIDIA kernel driver"],
            &["install the NVIDIA driver"],
        );
        // Nothing at all.
        let none = Fake::new();
        assert_eq!(
            check_cuda(&none.host(), &[], &Env::default()).status,
            Status::Absent
        );
        assert_eq!(one(check_gpus(&[])).status, Status::Absent);
        assert_eq!(
            check_gpudirect(&none.host(), &[], true).status,
            Status::Absent
        );
        // libcuda found through LD_LIBRARY_PATH only.
        none.file("/opt/cuda/lib/libcuda.so.1", "");
        let env = Env {
            ld_library_path: Some("/nowhere::/opt/cuda/lib/".to_owned()),
            ..Env::default()
        };
        assert_has(
            &check_cuda(&none.host(), &[], &env),
            Status::Info,
            &["/opt/cuda/lib/libcuda.so.1"],
            &["--gpus all"],
        );
    }

    #[test]
    fn numa_placement() {
        let fake = Fake::new();
        fake.file("/sys/devices/system/node/node0/cpulist", "0-23")
            .file("/sys/devices/system/node/node1/cpulist", "24-47")
            .file("/sys/devices/system/node/possible", "0-1")
            .roce("4: ACTIVE", "5: LinkUp")
            .netdev("eth2", 9000, 1)
            .gpu("0000:3b:00.0", 0, 16);
        let host = fake.host();
        let (ports, gpus) = (rdma_ports(&host), nvidia_gpus(&host));
        let f = check_numa(&host, &ports, &gpus);
        assert_has(
            &f,
            Status::Warn,
            &[
                "2 nodes",
                "node0 (CPUs 0-23)",
                "node1 (CPUs 24-47)",
                "mlx5_0 on node 1",
                "GPU 0000:3b:00.0 on node 0",
            ],
            &["nvidia-smi topo -m"],
        );
        fake.gpu("0000:af:00.0", 1, 16);
        let f = check_numa(&host, &ports, &nvidia_gpus(&host));
        assert_has(
            &f,
            Status::Info,
            &["eth2 on node 1"],
            &["numactl --cpunodebind=1 --membind=1"],
        );

        let single = Fake::new();
        single.file("/sys/devices/system/node/node0/cpulist", "0-1");
        assert_has(
            &check_numa(&single.host(), &[], &[]),
            Status::Ok,
            &["1 node"],
            &[],
        );
        assert_eq!(
            check_numa(&Fake::new().host(), &[], &[]).status,
            Status::Info
        );
    }

    #[test]
    fn interfaces_that_count() {
        let fake = Fake::new();
        fake.netdev("eth0", 1500, -1)
            .netdev("eth10", 9000, -1)
            .netdev("eth2", 1500, -1)
            .file("/sys/class/net/lo/type", "772")
            .file("/sys/class/net/lo/flags", "0x9")
            .file("/sys/class/net/lo/operstate", "unknown")
            .file("/sys/class/net/lo/mtu", "65536")
            .file("/sys/class/net/down0/flags", "0x1002")
            .file("/sys/class/net/down0/operstate", "down")
            .file("/sys/class/net/tun0/type", "65534")
            .file("/sys/class/net/tun0/flags", "0x1091")
            .file("/sys/class/net/tun0/operstate", "unknown")
            .file("/sys/class/net/tun0/mtu", "1420");
        assert_eq!(
            up_interfaces(&fake.host()),
            ["eth0", "eth2", "eth10", "tun0"]
        );
        let found: Vec<_> = check_mtu(&fake.host(), &[])
            .into_iter()
            .map(|f| f.found)
            .collect();
        assert!(found[3].contains("tun0: 1420, virtual"), "{found:#?}");
        assert_eq!(
            one(check_mtu(&Fake::new().host(), &[])).status,
            Status::Info
        );
    }

    #[test]
    fn shm_dir_follows_the_library() {
        let fake = Fake::new();
        fake.file(
            "/proc/self/status",
            "Name:\thf\nUid:\t1000\t1001\t1000\t1000\n",
        )
        .dir("/run/user/1000");
        let env = |xdg: Option<&str>| Env {
            xdg_runtime_dir: xdg.map(str::to_owned),
            ..Env::default()
        };
        assert_eq!(
            shm_dir(&fake.host(), &env(Some("/run/user/1000/"))),
            "/run/user/1000/hyperframes"
        );
        assert_eq!(
            shm_dir(&fake.host(), &env(Some("/run/user/missing"))),
            "/tmp/hyperframes-1001"
        );
        assert_eq!(shm_dir(&fake.host(), &env(None)), "/tmp/hyperframes-1001");
        let f = check_shm(
            &fake.host(),
            &env(None),
            Probe::Failed(
                "/tmp/hyperframes-1001 is not a private directory of this user".to_owned(),
            ),
        );
        assert_has(
            &f,
            Status::Warn,
            &["failed"],
            &["chmod 700 /tmp/hyperframes-1001"],
        );
    }

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
    fn cuda_driver_probe_findings() {
        let f = check_cuda_driver(None);
        assert_eq!(f.status, Status::Info);
        assert!(f.fix.as_deref().unwrap().contains("--features cuda"));
        assert_eq!(check_cuda_driver(Some(Ok(0))).status, Status::Absent);
        let f = check_cuda_driver(Some(Ok(2)));
        assert_eq!(f.status, Status::Ok);
        assert!(f.found.contains("2 device(s)"), "{}", f.found);
        let f = check_cuda_driver(Some(Err("CUDA is not available: libcuda.so".into())));
        assert_eq!(f.status, Status::Absent);
        assert!(f.found.contains("libcuda"), "{}", f.found);
        // In this build, against this host: whatever it finds, it says something.
        assert!(!check_cuda_driver(probe_cuda()).found.is_empty());
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
