//! CPU and memory: the frequency governor, transparent huge pages, huge pages.

use super::host::Host;
use super::{Finding, Status};
use crate::units::human_bytes;

pub(super) fn check_governor(host: &Host) -> Finding {
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
pub(super) fn bracketed(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

pub(super) fn check_thp(host: &Host) -> Finding {
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

pub(super) fn check_hugepages(meminfo: Option<&str>) -> Finding {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::fake::{Fake, assert_has};

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
}
