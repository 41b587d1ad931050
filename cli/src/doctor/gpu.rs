//! NVIDIA GPUs and CUDA: the driver, libcuda, the GPUs' links, GPUDirect, and hyperframes' own CUDA probe.

use std::fmt::Write as _;

use super::host::{Env, Host, kernel_version, numa_node};
use super::{Finding, Status};

/// An NVIDIA display or 3D controller on the PCI bus.
#[derive(Debug)]
pub(super) struct Gpu {
    pub(super) address: String,
    pub(super) model: Option<String>,
    pub(super) numa: Option<u32>,
    pub(super) link_speed: Option<String>,
    pub(super) link_width: Option<u32>,
    pub(super) max_link_width: Option<u32>,
}

pub(super) fn nvidia_gpus(host: &Host) -> Vec<Gpu> {
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
pub(super) fn nvidia_driver(version_file: &str) -> Option<(String, bool)> {
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

pub(super) fn check_cuda(host: &Host, gpus: &[Gpu], env: &Env) -> Finding {
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
pub(super) fn probe_cuda() -> Option<Result<usize, String>> {
    #[cfg(feature = "cuda")]
    {
        Some(hyperframes::device::cuda_device_count().map_err(|e| e.to_string()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

pub(super) fn check_cuda_driver(probe: Option<Result<usize, String>>) -> Finding {
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

pub(super) fn check_gpus(gpus: &[Gpu]) -> Vec<Finding> {
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

pub(super) fn check_gpudirect(host: &Host, gpus: &[Gpu], rdma: bool) -> Finding {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has, one};

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
}
