//! Facts about the broker process that the API and the metrics report (Linux `/proc`).

/// Open file descriptors of this process (None where `/proc` is unavailable).
#[must_use]
pub fn open_fds() -> Option<u64> {
    // The directory handle itself is one of the entries while it is read.
    let n = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    Some(n.saturating_sub(1))
}

/// The soft limit on open file descriptors (`Max open files` in `/proc/self/limits`).
#[must_use]
pub fn max_fds() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_max_open_files(&limits)
}

fn parse_max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line["Max open files".len()..].split_whitespace().next()?;
    match soft {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_soft_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max processes             95124                95124                processes \n\
                    Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(text), Some(1024));
        assert_eq!(
            parse_max_open_files("Max open files  unlimited unlimited files"),
            Some(u64::MAX)
        );
        assert_eq!(parse_max_open_files("nothing"), None);
    }

    #[test]
    fn this_process_has_open_fds_below_its_limit() {
        let (open, max) = (open_fds().unwrap(), max_fds().unwrap());
        assert!(open >= 3 && open < max, "{open} of {max}");
    }
}
