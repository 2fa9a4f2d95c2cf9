//! vCPU pinning, as the selftests' `-c` does it (`kvm_parse_vcpu_pinning`): a list of host
//! CPUs, the i-th for vCPU i's thread, optionally one more for the main thread.
//!
//! [`parse_cpu_list`] reads `0,1,3-5`; [`PinPlan::new`] checks the list against the CPUs
//! this process may run on and the vCPU count; [`VcpuTids`] records each vCPU thread's
//! kernel thread id so the host can set its affinity ([`pin_thread`]) and read it back
//! ([`thread_affinity`]).

use std::fs;
use std::io;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Largest CPU number a list may name (the kernel's `cpu_set_t` holds 1024).
pub const MAX_CPU: usize = 1023;

/// Why a CPU list or a pinning plan was refused (messages name the selftests' `-c`).
#[derive(Debug, thiserror::Error)]
pub enum CpuListError {
    /// Nothing in the list.
    #[error("the CPU list is empty")]
    Empty,
    /// A part is neither a number nor a range.
    #[error("`{part}` in CPU list `{list}` is not a CPU number or a range like 3-5")]
    NotACpu {
        /// The part.
        part: String,
        /// The whole list.
        list: String,
    },
    /// A CPU number beyond [`MAX_CPU`].
    #[error("CPU {cpu} in `{list}` is above {MAX_CPU}")]
    TooHigh {
        /// The number.
        cpu: usize,
        /// The whole list.
        list: String,
    },
    /// A range whose end is below its start.
    #[error("range `{part}` in CPU list `{list}` is backwards")]
    Backwards {
        /// The range.
        part: String,
        /// The whole list.
        list: String,
    },
    /// More entries than any plan can use.
    #[error("CPU list `{list}` is too long")]
    TooLong {
        /// The whole list.
        list: String,
    },
    /// Fewer CPUs than vCPUs.
    #[error("-c names {given} CPU(s) for {vcpus} vCPUs: give one CPU per vCPU (and optionally one more for the main thread)")]
    TooFew {
        /// CPUs named.
        given: usize,
        /// vCPUs.
        vcpus: usize,
    },
    /// More than one CPU per vCPU plus the main thread's.
    #[error("-c names {given} CPUs for {vcpus} vCPU(s): at most one per vCPU plus one for the main thread")]
    TooMany {
        /// CPUs named.
        given: usize,
        /// vCPUs.
        vcpus: usize,
    },
    /// A CPU that is not online.
    #[error("-c: CPU {cpu} is not online (online: {online})")]
    Offline {
        /// The CPU.
        cpu: usize,
        /// The online CPUs, as a list.
        online: String,
    },
    /// A CPU outside this process's affinity mask.
    #[error("-c: CPU {cpu} is not in this process's affinity mask (allowed: {allowed})")]
    NotAllowed {
        /// The CPU.
        cpu: usize,
        /// The allowed CPUs, as a list.
        allowed: String,
    },
    /// The host's CPU sets could not be read.
    #[error("cannot read {what}: {source}")]
    Host {
        /// Which set.
        what: &'static str,
        /// Why.
        source: io::Error,
    },
}

/// Parses a CPU list: comma-separated CPU numbers and inclusive ranges (`0,1,3-5`), in the
/// order given (ranges expand ascending). Repeats are allowed (two vCPUs may share a CPU).
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, CpuListError> {
    let mut out = Vec::new();
    if s.trim().is_empty() {
        return Err(CpuListError::Empty);
    }
    for part in s.split(',') {
        let part = part.trim();
        let num = |t: &str| -> Result<usize, CpuListError> {
            let v: usize = t.trim().parse().map_err(|_| CpuListError::NotACpu {
                part: part.into(),
                list: s.into(),
            })?;
            if v > MAX_CPU {
                return Err(CpuListError::TooHigh {
                    cpu: v,
                    list: s.into(),
                });
            }
            Ok(v)
        };
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (num(lo)?, num(hi)?);
                if lo > hi {
                    return Err(CpuListError::Backwards {
                        part: part.into(),
                        list: s.into(),
                    });
                }
                out.extend(lo..=hi);
            }
            None => out.push(num(part)?),
        }
        if out.len() > MAX_CPU + 1 + 512 {
            return Err(CpuListError::TooLong { list: s.into() });
        }
    }
    Ok(out)
}

/// The CPUs this process may run on: its affinity mask (itself a subset of the online CPUs).
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    thread_affinity(0)
}

/// The host's online CPUs (`/sys/devices/system/cpu/online`).
pub fn online_cpus() -> io::Result<Vec<usize>> {
    let s = fs::read_to_string("/sys/devices/system/cpu/online")?;
    parse_cpu_list(s.trim()).map_err(io::Error::other)
}

/// Where each vCPU's thread goes, and the main thread if the list has one more entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinPlan {
    /// `vcpus[i]`: the CPU of vCPU i's thread.
    pub vcpus: Vec<usize>,
    /// The CPU of the thread driving the benchmark, if given.
    pub main: Option<usize>,
}

impl PinPlan {
    /// Checks `list` (from [`parse_cpu_list`]) for `nr_vcpus` vCPUs: one CPU per vCPU, then
    /// at most one for the main thread, each online and allowed for this process.
    pub fn new(list: &[usize], nr_vcpus: usize) -> Result<PinPlan, CpuListError> {
        let online = online_cpus().map_err(|source| CpuListError::Host {
            what: "the online CPUs",
            source,
        })?;
        let allowed = allowed_cpus().map_err(|source| CpuListError::Host {
            what: "this process's CPUs",
            source,
        })?;
        Self::check(list, nr_vcpus, &online, &allowed)
    }

    /// [`PinPlan::new`] against given online and allowed sets.
    pub fn check(
        list: &[usize],
        nr_vcpus: usize,
        online: &[usize],
        allowed: &[usize],
    ) -> Result<PinPlan, CpuListError> {
        let (given, vcpus) = (list.len(), nr_vcpus);
        if given < vcpus {
            return Err(CpuListError::TooFew { given, vcpus });
        }
        if given > vcpus + 1 {
            return Err(CpuListError::TooMany { given, vcpus });
        }
        for &cpu in list {
            if !online.contains(&cpu) {
                let online = format_cpu_list(online);
                return Err(CpuListError::Offline { cpu, online });
            }
            if !allowed.contains(&cpu) {
                let allowed = format_cpu_list(allowed);
                return Err(CpuListError::NotAllowed { cpu, allowed });
            }
        }
        Ok(PinPlan {
            vcpus: list[..nr_vcpus].to_vec(),
            main: list.get(nr_vcpus).copied(),
        })
    }
}

/// `0-3,5` for `[0, 1, 2, 3, 5]` (sorted, duplicates dropped).
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// The calling thread's kernel thread id.
pub fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Restricts thread `tid` (0: the calling thread) to CPU `cpu` (`sched_setaffinity`).
pub fn pin_thread(tid: i32, cpu: usize) -> io::Result<()> {
    if cpu > MAX_CPU {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {cpu} is above {MAX_CPU}"),
        ));
    }
    // SAFETY: an all-zero cpu_set_t is a valid empty set; CPU_SET is given an index below
    // the set's capacity (checked above), and sched_setaffinity reads `size_of` bytes of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs thread `tid` (0: the calling thread) may run on (`sched_getaffinity`).
pub fn thread_affinity(tid: i32) -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set; sched_getaffinity writes at most
    // `size_of` bytes into it; CPU_ISSET is given indices below its capacity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((0..=MAX_CPU)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

/// Kernel thread ids of a machine's vCPU threads, each published by the thread when it
/// starts.
#[derive(Debug)]
pub struct VcpuTids(Vec<AtomicI32>);

impl VcpuTids {
    /// Room for `n` vCPUs (at most [`crate::MAX_RENDEZVOUS_VCPUS`]), none started.
    pub fn new(n: usize) -> Result<VcpuTids, crate::RendezvousError> {
        if n > crate::MAX_RENDEZVOUS_VCPUS {
            return Err(crate::RendezvousError::Vcpus(n));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| crate::RendezvousError::Alloc(n))?;
        v.resize_with(n, || AtomicI32::new(0));
        Ok(VcpuTids(v))
    }

    /// Called by vCPU `idx`'s thread first thing.
    pub fn publish(&self, idx: usize) {
        if let Some(t) = self.0.get(idx) {
            t.store(gettid(), Ordering::Release);
        }
    }

    /// Every vCPU thread's id, waiting (at most 10 s) for threads that have not started yet.
    pub fn all(&self) -> io::Result<Vec<i32>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v: Vec<i32> = self.0.iter().map(|t| t.load(Ordering::Acquire)).collect();
            if v.iter().all(|&t| t != 0) {
                return Ok(v);
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("vCPU threads did not start within 10 s"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Pins vCPU i's thread to `cpus[i]` and returns each thread's affinity as the kernel
    /// then reports it (one CPU each if pinning worked).
    pub fn pin(&self, cpus: &[usize]) -> io::Result<Vec<Vec<usize>>> {
        let tids = self.all()?;
        if cpus.len() != tids.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} CPUs for {} vCPU threads", cpus.len(), tids.len()),
            ));
        }
        for (&tid, &cpu) in tids.iter().zip(cpus) {
            pin_thread(tid, cpu)?;
        }
        tids.iter().map(|&t| thread_affinity(t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_ranges() {
        assert_eq!(parse_cpu_list("0,1,3-5").unwrap(), vec![0, 1, 3, 4, 5]);
        assert_eq!(parse_cpu_list("2").unwrap(), vec![2]);
        assert_eq!(parse_cpu_list("1,1").unwrap(), vec![1, 1]);
        for bad in ["", "a", "1,", "5-3", "-1", "1-", "99999", "0,,1"] {
            let e = parse_cpu_list(bad).unwrap_err().to_string();
            assert!(!e.contains('\n'), "{e}");
        }
        assert_eq!(format_cpu_list(&[5, 0, 1, 2, 3, 5]), "0-3,5");
    }

    #[test]
    fn checks_against_host_and_vcpus() {
        let on = [0, 1, 2, 3];
        let p = PinPlan::check(&[1, 0], 2, &on, &on).unwrap();
        assert_eq!((p.vcpus, p.main), (vec![1, 0], None));
        let p = PinPlan::check(&[1, 0, 3], 2, &on, &on).unwrap();
        assert_eq!(p.main, Some(3));
        assert!(PinPlan::check(&[1], 2, &on, &on)
            .unwrap_err()
            .to_string()
            .contains("one CPU per vCPU"));
        assert!(PinPlan::check(&[0, 1, 2, 3], 2, &on, &on).is_err());
        assert!(PinPlan::check(&[7], 1, &on, &on)
            .unwrap_err()
            .to_string()
            .contains("not online"));
        assert!(PinPlan::check(&[2], 1, &on, &[0, 1])
            .unwrap_err()
            .to_string()
            .contains("affinity"));
    }

    #[test]
    fn pins_a_thread() {
        let allowed = allowed_cpus().unwrap();
        let cpu = *allowed.last().unwrap();
        let tids = std::sync::Arc::new(VcpuTids::new(1).unwrap());
        let (t2, stop) = (
            tids.clone(),
            std::sync::Arc::new(std::sync::Barrier::new(2)),
        );
        let s2 = stop.clone();
        let h = std::thread::spawn(move || {
            t2.publish(0);
            s2.wait();
            thread_affinity(0).unwrap()
        });
        let got = tids.pin(&[cpu]).unwrap();
        assert_eq!(got, vec![vec![cpu]]);
        stop.wait();
        assert_eq!(h.join().unwrap(), vec![cpu]);
    }
}
