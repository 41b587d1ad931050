//! Interfaces and socket buffers: MTUs, and the kernel's limits on socket buffer sizes.

use super::host::{Host, sysctl_path};
use super::rdma::RdmaPort;
use super::shm::approx_bytes;
use super::{Finding, Status};
use crate::units::human_bytes;

/// Non-loopback interfaces that are administratively up and not down, in natural order.
pub(super) fn up_interfaces(host: &Host) -> Vec<String> {
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

pub(super) fn check_mtu(host: &Host, ports: &[RdmaPort]) -> Vec<Finding> {
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

/// Recommended ceiling for socket buffers on 100 Gb/s links: 64 MiB.
const BUFFER_GOAL: u64 = 64 << 20;

pub(super) fn check_core_buffer(name: &'static str, value: Option<&str>) -> Finding {
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

pub(super) fn check_tcp_buffer(name: &'static str, value: Option<&str>) -> Finding {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has, one};

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
}
