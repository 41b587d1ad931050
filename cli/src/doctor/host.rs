//! Where the facts come from: the file system the checks read and the environment.

use std::path::PathBuf;

/// The file system the checks read: `/` itself, or a fake tree in tests.
pub(super) struct Host {
    root: PathBuf,
}

impl Host {
    pub(super) fn real() -> Host {
        Host::at("/")
    }

    pub(super) fn at(root: impl Into<PathBuf>) -> Host {
        Host { root: root.into() }
    }

    /// `path` (absolute, as on a real host) under the root.
    pub(super) fn path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    /// The trimmed contents of a file; `None` when it cannot be read as text (missing,
    /// refused, not UTF-8, or a sysfs attribute that errors on read).
    pub(super) fn read(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.path(path))
            .ok()
            .map(|s| s.trim().to_owned())
    }

    pub(super) fn read_num<T: std::str::FromStr>(&self, path: &str) -> Option<T> {
        self.read(path)?.parse().ok()
    }

    pub(super) fn exists(&self, path: &str) -> bool {
        self.path(path).exists()
    }

    /// The names in a directory, in natural order (`node2` before `node10`); empty when it
    /// cannot be read.
    pub(super) fn list(&self, path: &str) -> Vec<String> {
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
pub(super) fn natural_key(name: &str) -> (String, u64, String) {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    let number = name[stem.len()..].parse().unwrap_or(0);
    (stem.to_owned(), number, name.to_owned())
}

/// The environment variables the checks look at.
#[derive(Default)]
pub(super) struct Env {
    pub(super) hyperframes_io: Option<String>,
    pub(super) xdg_runtime_dir: Option<String>,
    pub(super) ld_library_path: Option<String>,
}

impl Env {
    pub(super) fn current() -> Env {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        Env {
            hyperframes_io: var("HYPERFRAMES_IO"),
            xdg_runtime_dir: var("XDG_RUNTIME_DIR"),
            ld_library_path: var("LD_LIBRARY_PATH"),
        }
    }
}

pub(super) fn sysctl_path(name: &str) -> String {
    format!("/proc/sys/{}", name.replace('.', "/"))
}

/// `"6.8.0-45-generic"` → `(6, 8)`.
pub(super) fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// A sysfs `numa_node`: `None` for -1 (no affinity reported) or anything unreadable.
pub(super) fn numa_node(host: &Host, path: &str) -> Option<u32> {
    host.read_num::<i64>(path)
        .and_then(|n| u32::try_from(n).ok())
}
