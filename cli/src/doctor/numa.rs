//! NUMA: whether NICs and GPUs sit on the node that uses them.

use super::gpu::Gpu;
use super::host::{Host, numa_node};
use super::net::up_interfaces;
use super::rdma::RdmaPort;
use super::{Finding, Status};

pub(super) fn check_numa(host: &Host, ports: &[RdmaPort], gpus: &[Gpu]) -> Finding {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has};
    use crate::doctor::gpu::nvidia_gpus;
    use crate::doctor::rdma::rdma_ports;

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
}
