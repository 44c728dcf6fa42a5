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
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(0.0, |stat| stat_cpu_seconds(&stat).1)
}

/// The command name and the user + system CPU seconds of one `stat` line.
fn stat_cpu_seconds(stat: &str) -> (String, f64) {
    // The command name is parenthesised (and may hold spaces); utime and
    // stime are the 12th and 13th fields after it.
    let Some((head, rest)) = stat.rsplit_once(')') else {
        return (String::new(), 0.0);
    };
    let name = head.split_once('(').map_or("", |(_, name)| name).to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    (name, ticks / 100.0) // USER_HZ is 100 on Linux
}

/// CPU seconds of each thread of `pid` now: thread id → (name, seconds).
pub fn thread_cpu_seconds(pid: &str) -> std::collections::BTreeMap<u64, (String, f64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Default::default();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let tid: u64 = task.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            Some((tid, stat_cpu_seconds(&stat)))
        })
        .collect()
}

/// What each thread used between two [`thread_cpu_seconds`] readings,
/// busiest first (a thread that ended in between is not counted).
pub fn threads_since(
    before: &std::collections::BTreeMap<u64, (String, f64)>,
    after: &std::collections::BTreeMap<u64, (String, f64)>,
) -> Vec<(String, f64)> {
    let mut used: Vec<(String, f64)> = after
        .iter()
        .map(|(tid, (name, secs))| {
            let start = before.get(tid).map_or(0.0, |(_, secs)| *secs);
            (format!("{name}/{tid}"), secs - start)
        })
        .filter(|(_, secs)| *secs > 0.0)
        .collect();
    used.sort_by(|a, b| b.1.total_cmp(&a.1));
    used
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
