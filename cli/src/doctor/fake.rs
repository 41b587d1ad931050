//! A fake host for the checks' tests: a root file system in a temporary directory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::host::Host;
use super::{Finding, Status};

/// A fake root file system in a temporary directory, removed when dropped.
pub(super) struct Fake {
    root: PathBuf,
}

impl Fake {
    pub(super) fn new() -> Fake {
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
    pub(super) fn file(&self, path: &str, contents: &str) -> &Fake {
        let p = self.root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{contents}\n")).unwrap();
        self
    }

    pub(super) fn dir(&self, path: &str) -> &Fake {
        std::fs::create_dir_all(self.root.join(path.trim_start_matches('/'))).unwrap();
        self
    }

    pub(super) fn host(&self) -> Host {
        Host::at(&self.root)
    }

    /// An interface that is up, with a PCI device behind it unless `virtual_`.
    pub(super) fn netdev(&self, name: &str, mtu: u32, numa: i32) -> &Fake {
        let dir = format!("/sys/class/net/{name}");
        self.file(&format!("{dir}/mtu"), &mtu.to_string())
            .file(&format!("{dir}/flags"), "0x1003")
            .file(&format!("{dir}/operstate"), "up")
            .file(&format!("{dir}/type"), "1")
            .file(&format!("{dir}/device/numa_node"), &numa.to_string())
    }

    /// `mlx5_0` port 1 over RoCE on `eth2`, with a link-local RoCE v1 GID, an
    /// IPv4-mapped RoCE v2 GID and an unused one.
    pub(super) fn roce(&self, state: &str, phys: &str) -> &Fake {
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
    pub(super) fn gpu(&self, addr: &str, numa: i32, width: u32) -> &Fake {
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

    pub(super) fn nvidia_driver(&self, open: bool) -> &Fake {
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

pub(super) fn one(findings: Vec<Finding>) -> Finding {
    assert_eq!(findings.len(), 1, "{findings:#?}");
    findings.into_iter().next().unwrap()
}

pub(super) fn assert_has(f: &Finding, status: Status, found: &[&str], fix: &[&str]) {
    assert_eq!(f.status, status, "{f:#?}");
    for needle in found {
        assert!(f.found.contains(needle), "found lacks {needle:?}: {f:#?}");
    }
    for needle in fix {
        let text = f.fix.as_deref().unwrap_or_default();
        assert!(text.contains(needle), "fix lacks {needle:?}: {f:#?}");
    }
}
