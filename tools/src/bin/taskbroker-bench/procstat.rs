//! What a process (or the machine) has used, read from `/proc`.

/// Peak resident set size (VmHWM) of `pid` (`"self"` or a number), KiB.
pub fn peak_rss_kib(pid: &str) -> u64 {
    status_kib(pid, "VmHWM:")
}

/// Resident set size now (VmRSS) of `pid`, KiB.
pub fn rss_kib(pid: &str) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `kB` field of `/proc/<pid>/status`; 0 if there is none.
fn status_kib(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with(field))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

/// User + system CPU seconds `pid` has used.
pub fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the
    // 12th and 13th of those.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    ticks / 100.0 // USER_HZ is 100 on Linux
}

/// CPU seconds the whole machine has spent busy (all cores, everything but
/// idle and iowait).
pub fn machine_busy_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().find(|line| line.starts_with("cpu ")) else {
        return 0.0;
    };
    let fields: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: f64 = fields
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4 && *i < 8)
        .map(|(_, v)| v)
        .sum();
    busy / 100.0
}
