//! Shared memory: the shm:// probe, the runtime directory and /dev/shm.

use std::path::Path;

use super::host::{Env, Host};
use super::probe::Probe;
use super::{Finding, Status};

/// The effective user id, from `Uid:` in `/proc/self/status`.
pub(super) fn effective_uid(status: &str) -> Option<u32> {
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

pub(super) fn check_shm(host: &Host, env: &Env, probe: Probe) -> Finding {
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

pub(super) fn check_dev_shm(host: &Host) -> Finding {
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
pub(super) fn approx_bytes(n: u64) -> String {
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
    use crate::doctor::fake::{Fake, assert_has};

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
}
