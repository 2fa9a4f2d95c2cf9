//! What this host can hold: the bound on guest memory that a user or a peer may ask for.
//!
//! A guest is mapped (and on the simulated machine pre-faulted) in full, so more memory than
//! the host's RAM and swap together can never run: a destination refuses such a guest before
//! it maps anything, and the command line refuses such flags before it builds anything.

/// The host's physical RAM plus swap in bytes (`MemTotal` + `SwapTotal` of `/proc/meminfo`),
/// or `None` when that cannot be read.
pub fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

/// `MemTotal` + `SwapTotal` of a `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Option<u64> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<u64>()
                .ok()
        })
    };
    let ram = field("MemTotal:")?;
    let swap = field("SwapTotal:").unwrap_or(0);
    ram.checked_add(swap)?.checked_mul(1024)
}

/// The most guest memory to accept: `configured` (0: no limit of its own) and the host's
/// RAM and swap, whichever is smaller, with the reason for the one that applies.
pub fn memory_limit(configured: u64) -> Option<(u64, &'static str)> {
    let host = host_memory().map(|h| (h, "the host's RAM and swap"));
    let own = (configured != 0).then_some((configured, "its configured maximum"));
    match (own, host) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_adds_ram_and_swap() {
        let t = "MemTotal:       24684100 kB\nMemFree:  1 kB\nSwapTotal:        1024 kB\n";
        assert_eq!(parse_meminfo(t), Some((24_684_100 + 1024) * 1024));
        assert_eq!(parse_meminfo("MemTotal: 8 kB\n"), Some(8192));
        assert_eq!(parse_meminfo("SwapTotal: 8 kB\n"), None);
        assert_eq!(parse_meminfo("MemTotal: 18446744073709551615 kB\n"), None);
        assert!(host_memory().is_some_and(|b| b > 0));
    }

    #[test]
    fn the_smaller_limit_applies() {
        let host = host_memory().unwrap();
        assert_eq!(memory_limit(4096), Some((4096, "its configured maximum")));
        assert_eq!(memory_limit(0), Some((host, "the host's RAM and swap")));
        assert_eq!(
            memory_limit(u64::MAX),
            Some((host, "the host's RAM and swap"))
        );
    }
}
