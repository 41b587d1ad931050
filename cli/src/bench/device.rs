//! `hf bench --device`: bodies in device memory (feature `cuda`). Without the feature there
//! is no device ([`Gpu`] has no values), and asking for one is a usage error.

use hyperframes::{Body, ChannelInfo, ContextBuilder};

use crate::Failure;

#[cfg(feature = "cuda")]
pub(crate) use hyperframes::device::Gpu;

/// No device without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Debug)]
pub(crate) enum Gpu {}

/// `cuda` (device 0), `cuda:N`, or `stand-in` (host memory handled as a device).
pub(crate) fn open(spec: &str) -> Result<Gpu, Failure> {
    #[cfg(feature = "cuda")]
    {
        let spec = spec.trim().to_ascii_lowercase();
        let gpu = match spec.as_str() {
            "stand-in" | "standin" => Ok(Gpu::stand_in()),
            "cuda" => Gpu::cuda(0),
            s => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => Gpu::cuda(n),
                None => {
                    return Err(Failure::usage(format!(
                        "bad --device {spec:?}: expected cuda, cuda:N or stand-in"
                    )));
                }
            },
        };
        gpu.map_err(|e| Failure::runtime(format!("--device {spec}: {e:#}")))
    }
    #[cfg(not(feature = "cuda"))]
    Err(Failure::usage(format!(
        "--device {spec}: this hf was built without device bodies; build it with \
         `--features cuda`"
    )))
}

/// Received bodies land on `gpu` (the kind of device the sender's bodies are on); with
/// `ipc` false, `shm://` stages them instead of mapping the sender's memory.
pub(crate) fn land(
    b: ContextBuilder,
    gpu: Option<&Gpu>,
    ipc: bool,
    gpudirect: bool,
) -> ContextBuilder {
    #[cfg(all(feature = "cuda", feature = "rdma"))]
    let b = b.rdma_gpudirect(gpudirect);
    #[cfg(not(all(feature = "cuda", feature = "rdma")))]
    let _ = gpudirect;
    match gpu {
        #[cfg(all(feature = "cuda", feature = "shm"))]
        Some(g) => b.land_on(g.clone()).shm_cuda_ipc(ipc),
        #[cfg(all(feature = "cuda", not(feature = "shm")))]
        Some(g) => {
            let _ = ipc;
            b.land_on(g.clone())
        }
        #[cfg(not(feature = "cuda"))]
        Some(g) => {
            let _ = ipc;
            match *g {}
        }
        None => b,
    }
}

/// `count` bodies of `size` bytes on `gpu`, each holding `fill`'s pattern.
pub(crate) fn bodies(
    gpu: &Gpu,
    size: usize,
    count: usize,
    fill: fn(&mut [u8]),
) -> Result<Vec<Body>, String> {
    #[cfg(feature = "cuda")]
    {
        let mut host = vec![0u8; size];
        fill(&mut host);
        (0..count)
            .map(|_| gpu.upload(&host).map(Body::from).map_err(|e| e.to_string()))
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (size, count, fill);
        match *gpu {}
    }
}

/// For a body in device memory: whether `check` passes on a copy of it in host memory.
/// `None` for a host body.
pub(crate) fn check(body: &Body, check: fn(&[u8]) -> bool) -> Option<bool> {
    #[cfg(feature = "cuda")]
    return body
        .as_device()
        .map(|d| d.to_host().is_ok_and(|b| check(&b)));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (body, check);
        None
    }
}

/// A plain device-to-device copy of `size` bytes on `gpu`, in GB/s (over ~300 ms): the
/// baseline of device bandwidth.
pub(crate) fn copy_gbytes_per_s(gpu: &Gpu, size: usize) -> Result<f64, String> {
    #[cfg(feature = "cuda")]
    {
        let (a, b) = (
            gpu.alloc(size).map_err(|e| e.to_string())?,
            gpu.alloc(size).map_err(|e| e.to_string())?,
        );
        let started = std::time::Instant::now();
        let mut n = 0usize;
        while started.elapsed() < std::time::Duration::from_millis(300) || n < 8 {
            b.copy_from(&a).map_err(|e| e.to_string())?;
            n += 1;
        }
        Ok((n * size) as f64 / started.elapsed().as_secs_f64() / 1e9)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = size;
        match *gpu {}
    }
}

/// How the device bodies sent on a channel travelled, for a note under the table.
pub(crate) fn paths(info: &ChannelInfo) -> String {
    #[cfg(feature = "cuda")]
    {
        let d = info.device_bodies();
        let mut s = format!(
            "device bodies: {} lent (cuda-ipc), {} staged, {} in-process",
            d.lent, d.staged, d.in_process
        );
        if info.transport() == "rdma" {
            s += &format!(", {} read by the NIC (gpudirect)", d.gpudirect);
        }
        s
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = info;
        String::new()
    }
}
