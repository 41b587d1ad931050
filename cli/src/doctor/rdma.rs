//! RDMA: ports, their link layer, state, MTU and GIDs, and the uverbs devices.

use std::fmt::Write as _;
use std::net::Ipv6Addr;

use super::host::{Host, numa_node};
use super::net::up_interfaces;
use super::{Finding, Status};

/// One port of an RDMA device, as sysfs shows it.
#[derive(Debug)]
pub(super) struct RdmaPort {
    pub(super) device: String,
    pub(super) port: String,
    /// `ACTIVE`, `DOWN`, `INIT`… (the word after `4: `).
    pub(super) state: String,
    pub(super) phys_state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub(super) link_layer: String,
    pub(super) rate: Option<String>,
    /// The Ethernet device under a RoCE port.
    pub(super) netdev: Option<String>,
    pub(super) netdev_mtu: Option<u32>,
    /// Non-zero GIDs: index, address, type (`RoCE v2`, `IB/RoCE v1`).
    pub(super) gids: Vec<(u32, Ipv6Addr, Option<String>)>,
    pub(super) numa: Option<u32>,
}

/// `"4: ACTIVE"` → `"ACTIVE"`.
pub(super) fn sysfs_word(text: &str) -> String {
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

pub(super) fn rdma_ports(host: &Host) -> Vec<RdmaPort> {
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

pub(super) fn check_rdma(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
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

pub(super) fn check_uverbs(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
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
            match open_rw(&path) {
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

/// Opens a device node for reading and writing, as rdma-core does.
fn open_rw(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
}

/// rdma_cm, through which `rdma://` sets connections up (the TCP set-up exchange otherwise).
pub(super) fn check_rdma_cm(host: &Host, ports: &[RdmaPort]) -> Finding {
    const CHECK: &str = "rdma_cm";
    const NODE: &str = "/dev/infiniband/rdma_cm";
    if ports.is_empty() {
        return Finding::new(CHECK, Status::Absent, "no RDMA device: rdma_cm not needed");
    }
    if !host.exists(NODE) {
        return Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "no {NODE}: rdma:// falls back to its TCP set-up exchange (device, port and GID \
                 index from HYPERFRAMES_RDMA_* instead of the peer's address)"
            ),
        )
        .fix(
            "sudo modprobe rdma_ucm\n\
             in a container: docker run --device=/dev/infiniband/rdma_cm",
        );
    }
    match open_rw(&host.path(NODE)) {
        Ok(_) => Finding::new(
            CHECK,
            Status::Ok,
            format!("{NODE} opens: rdma:// sets connections up through rdma_cm"),
        ),
        Err(e) => Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "{NODE} cannot be opened ({e:#}): rdma:// falls back to its TCP set-up exchange"
            ),
        )
        .fix(format!(
            "sudo chmod 666 {NODE}    (until reboot; for good, a udev rule: \
             KERNEL==\"rdma_cm\", MODE=\"0666\")"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has, one};
    use crate::doctor::net::check_mtu;

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
    fn rdma_cm_missing_or_openable() {
        let fake = Fake::new();
        let f = check_rdma_cm(&fake.host(), &[]);
        assert_has(&f, Status::Absent, &["no RDMA device"], &[]);
        fake.roce("4: ACTIVE", "5: LinkUp").netdev("eth2", 9000, 1);
        let ports = rdma_ports(&fake.host());
        let f = check_rdma_cm(&fake.host(), &ports);
        assert_has(
            &f,
            Status::Warn,
            &["no /dev/infiniband/rdma_cm", "TCP set-up exchange"],
            &["sudo modprobe rdma_ucm"],
        );
        fake.file("/dev/infiniband/rdma_cm", "");
        let f = check_rdma_cm(&fake.host(), &ports);
        assert_has(&f, Status::Ok, &["through rdma_cm"], &[]);
    }
}
