//! The cache-line model: who owns each line, who shares it, and when it is free again.
//!
//! Keyed by `addr >> 6`. Only identity of addresses matters: costs depend on which CPU touched
//! a line last and when, and entries leave the table by virtual time (untouched for
//! `retention`), never by address, so ASLR cannot change a result and the table stays bounded.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use super::calendar::Calendar;
use super::owners::Owners;
use super::FastHash;

/// The most simulated CPUs a sharer set holds.
pub const MAX_CPUS: usize = 256;

/// A set of CPU indices below [`MAX_CPUS`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CpuSet([u64; MAX_CPUS / 64]);

impl CpuSet {
    fn only(cpu: usize) -> CpuSet {
        let mut s = CpuSet::default();
        s.insert(cpu);
        s
    }

    fn insert(&mut self, cpu: usize) {
        if let Some(w) = self.0.get_mut(cpu / 64) {
            *w |= 1 << (cpu % 64);
        }
    }

    fn contains(&self, cpu: usize) -> bool {
        self.0
            .get(cpu / 64)
            .is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    }

    fn len(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

/// No owner: the line was never written since it entered the table.
const NO_OWNER: usize = usize::MAX;

#[derive(Debug, Clone)]
struct Line {
    /// Who owned it when, for writes that arrive late (`owners.rs`); its latest run is the
    /// owner ([`Line::owner`]).
    owners: Owners,
    /// CPUs holding a copy (the owner included).
    sharers: CpuSet,
    /// Its recent read-modify-writes: a new one takes the first gap at or after its request
    /// (RMWs on a line serialise).
    busy: Calendar,
    /// The latest virtual time anyone touched it.
    last_touch: u64,
    /// When its latest write (RMW or store) completed, 0 if never written.
    written: u64,
    /// The CPU of its latest write in simulation order ([`NO_OWNER`] if none): the other
    /// sharers loaded it since.
    last_writer: usize,
}

impl Line {
    /// The CPU of its latest write in virtual time, or [`NO_OWNER`] if it was only read.
    fn owner(&self) -> usize {
        self.owners.latest().unwrap_or(NO_OWNER)
    }
}

/// Costs of the line model, in ps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LineCosts {
    pub rmw_local: u64,
    pub transfer: u64,
    pub invalidate: u64,
    pub dram_miss: u64,
    pub dram_stream: u64,
    pub retention: u64,
}

/// Counters of the line model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LineStats {
    /// Read-modify-writes modelled.
    pub rmws: u64,
    /// Plain stores modelled.
    pub stores: u64,
    /// Shared loads modelled.
    pub loads: u64,
    /// Accesses that paid a line transfer.
    pub transfers: u64,
    /// Accesses to a line in no cache.
    pub misses: u64,
    /// Of those, lines fetched as a stream (the line before them in their page was cached).
    pub streamed: u64,
    /// Lines in the table now. (a gauge: not in reports, which give counts)
    #[serde(skip)]
    pub lines: u64,
    /// Busy intervals dropped that a late request could still have met (the floor was held
    /// back past the calendar's bound); 0 in a faithful run.
    pub calendar_evictions: u64,
    /// Writes by a CPU holding a copy of a line another CPU wrote last: an upgrade (the
    /// other copies invalidated), not a transfer.
    pub upgrades: u64,
    /// Charges made late: a transfer for a write that arrived after another CPU's later
    /// writes to the line, which had been charged as that CPU's own line (`owners.rs`;
    /// included in `transfers`), or an upgrade for a read that did (the writer's next write).
    pub late_transfers: u64,
}

/// How [`Lines::write`] prices a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Write(u8);

impl Write {
    /// A write landing inside another CPU's run of writes owes that CPU a transfer
    /// (`owners.rs`); lock words, which the lock model orders, do not.
    const LATE: Write = Write(1);
    /// A line no cache holds costs a DRAM miss (guest data does not: `guest_access` has it).
    const COLD: Write = Write(2);

    fn contains(self, other: Write) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Write {
    type Output = Write;
    fn bitor(self, o: Write) -> Write {
        Write(self.0 | o.0)
    }
}

/// Every line touched within the last `retention`.
#[derive(Debug)]
pub(crate) struct Lines {
    map: HashMap<u64, Line, FastHash>,
    costs: LineCosts,
    next_sweep: u64,
    stats: LineStats,
    /// The scheduler's floor: no CPU can request before it (calendar.rs).
    floor: u64,
    /// CPUs owed a late charge (a transfer, or an upgrade after a late read) and its cost,
    /// for the scheduler to add to their clocks.
    owed: Vec<(usize, u64)>,
}

impl Lines {
    pub(crate) fn new(costs: LineCosts) -> Lines {
        Lines {
            map: HashMap::default(),
            costs,
            next_sweep: costs.retention,
            stats: LineStats::default(),
            floor: 0,
            owed: Vec::new(),
        }
    }

    /// A CPU that owes a late charge and its cost (one entry per charge), until none is left.
    pub(crate) fn pop_owed(&mut self) -> Option<(usize, u64)> {
        self.owed.pop()
    }

    /// Raises the floor: no CPU will request before `floor` (the lowest clock of every CPU).
    pub(crate) fn set_floor(&mut self, floor: u64) {
        self.floor = self.floor.max(floor);
    }

    /// The floor ([`set_floor`](Self::set_floor)).
    pub(crate) fn floor(&self) -> u64 {
        self.floor
    }

    /// The line of `addr`.
    #[inline]
    pub(crate) fn line_of(addr: usize) -> u64 {
        (addr >> 6) as u64
    }

    /// A read-modify-write by `cpu`, ready at `t`: returns when it completes. It starts when
    /// the line's previous RMW has completed (RMWs on a line serialise) and costs `rmw_local`,
    /// plus a transfer if another CPU owns the line, plus an invalidation per other sharer.
    pub(crate) fn rmw(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.stats.rmws += 1;
        self.write(
            cpu,
            t,
            line,
            self.costs.rmw_local,
            Write::LATE | Write::COLD,
        )
    }

    /// [`rmw`](Self::rmw) on a lock's word, as the lock is taken at once or released in
    /// exclusive mode: priced by the word's latest writer, and owing no other CPU a transfer.
    /// The lock model already orders exclusive holders in virtual time (its calendar and
    /// hand-off costs); readers it admits together, so their RMWs on the word are plain
    /// [`rmw`](Self::rmw)s, turns on a line like any other. Pricing
    /// its word by the runs of writes as well counted its turns twice (a program of six CPUs
    /// on one mutex came out 17.9% over the exact order at a 10 µs lookahead, against 8.1%).
    pub(crate) fn rmw_lock_word(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.stats.rmws += 1;
        self.write(cpu, t, line, self.costs.rmw_local, Write::COLD)
    }

    /// A plain store by `cpu` at `t`: as an RMW (it serialises with the line's RMWs and takes
    /// the line), but not a locked instruction, so a line the CPU owns costs nothing.
    pub(crate) fn store(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.stats.stores += 1;
        self.write(cpu, t, line, 0, Write::LATE | Write::COLD)
    }

    /// A guest data write by `cpu` at `t` to memory several vCPUs access: as a
    /// [`store`](Self::store), except that a line no cache holds costs nothing here (the
    /// access's own `guest_access` charge already covers memory).
    pub(crate) fn data_write(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.stats.stores += 1;
        self.write(cpu, t, line, 0, Write::LATE)
    }

    /// A guest data read by `cpu` at `t`: as a [`load`](Self::load), except that a line no
    /// cache holds costs nothing here (see [`data_write`](Self::data_write)).
    pub(crate) fn data_load(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.load_priced(cpu, t, line, false)
    }

    /// A write of `base` cost plus what moving the line costs: a transfer if another CPU
    /// owned it when the write starts, in virtual time (`owners.rs`).
    fn write(&mut self, cpu: usize, t: u64, line: u64, base: u64, how: Write) -> u64 {
        self.sweep(t);
        let c = self.costs;
        let late = how.contains(Write::LATE);
        // A miss's price depends on its neighbour, which the entry below would keep borrowed.
        let miss = if !how.contains(Write::COLD) || self.map.contains_key(&line) {
            0
        } else {
            self.miss_cost(line)
        };
        // In place: the entry (its calendar) is large, and copying it out and back cost
        // more than the rest of the model.
        let l = match self.map.entry(line) {
            Entry::Vacant(v) => v.insert(Line {
                owners: Owners::default(),
                sharers: CpuSet::only(cpu),
                busy: Calendar::default(),
                last_touch: t,
                written: 0,
                last_writer: NO_OWNER,
            }),
            Entry::Occupied(o) => o.into_mut(),
        };
        // A CPU holding a copy of another CPU's write (it loaded the line since the latest
        // write in simulation order, and that write completed before this one asks, in
        // virtual time) upgrades it: every other copy is invalidated, the owner's included,
        // and no data moves. One without a copy fetches the line from its owner, whose copy
        // goes with the transfer (docs/design/virtual-time.md §3, "Coherence").
        let owner = l.owner();
        let holds = owner != cpu
            && owner != NO_OWNER
            && l.last_writer != cpu
            && l.sharers.contains(cpu)
            && l.written <= t;
        let mut others = l.sharers;
        clear(&mut others, cpu);
        if !holds {
            clear(&mut others, l.owner());
        }
        let inval = c.invalidate.saturating_mul(others.len());
        let fixed = base.saturating_add(miss).saturating_add(inval);
        let moved = |at: u64| !holds && l.owners.at(at).is_some_and(|o| o != cpu);
        let cost_if = |moved: bool| fixed.saturating_add(if moved { c.transfer } else { 0 });
        // Who owns the line when the write starts; the start depends on the cost, so a write
        // that had to wait asks again at its start (once: another wait is rarer still).
        let (transfer, start) = if late {
            let mut transfer = moved(t);
            let mut start = l.busy.fit(t, cost_if(transfer), true, 0);
            if start != t && moved(start) != transfer {
                transfer = !transfer;
                start = l.busy.fit(t, cost_if(transfer), true, 0);
            }
            (transfer, start)
        } else {
            let transfer = !holds && owner != cpu && owner != NO_OWNER;
            (transfer, l.busy.fit(t, cost_if(transfer), true, 0))
        };
        let cost = cost_if(transfer);
        if transfer {
            self.stats.transfers += 1;
        } else if holds {
            self.stats.upgrades += 1;
        }
        let end = start.saturating_add(cost);
        self.stats.calendar_evictions += l.busy.insert(start, end, true, self.floor);
        if let Some(owes) = l.owners.write(cpu, end, self.floor).filter(|_| late) {
            self.stats.calendar_evictions += late_transfer(l, owes, c.transfer, self.floor);
            self.stats.transfers += 1;
            self.stats.late_transfers += 1;
            self.owed.push((owes.0, c.transfer));
        }
        l.sharers = CpuSet::only(cpu);
        l.last_writer = cpu;
        l.last_touch = l.busy.last_end().max(end);
        l.written = l.written.max(end);
        end
    }

    /// When the latest write to `line` by another CPU than `cpu` completed (its owner's, if
    /// that is not `cpu`), if any: a CPU that sees the data of that write cannot see it
    /// earlier, whatever order the simulation ran the two in.
    pub(crate) fn written_by_other(&self, cpu: usize, line: u64) -> Option<u64> {
        self.map
            .get(&line)
            .filter(|l| l.owner() != cpu && l.owner() != NO_OWNER && l.written > 0)
            .map(|l| l.written)
    }

    /// A load by `cpu` at `t` of a line other CPUs write: returns when the data is there. A
    /// CPU holding a copy pays nothing; one that does not pays a transfer if the line was
    /// written, a DRAM miss if no cache has it.
    pub(crate) fn load(&mut self, cpu: usize, t: u64, line: u64) -> u64 {
        self.load_priced(cpu, t, line, true)
    }

    /// [`load`](Self::load); a line no cache holds costs a miss only if `cold`.
    fn load_priced(&mut self, cpu: usize, t: u64, line: u64, cold: bool) -> u64 {
        self.sweep(t);
        self.stats.loads += 1;
        let c = self.costs;
        match self.map.get_mut(&line) {
            None => {
                let miss = if cold { self.miss_cost(line) } else { 0 };
                let end = t.saturating_add(miss);
                self.map.insert(
                    line,
                    Line {
                        owners: Owners::default(),
                        sharers: CpuSet::only(cpu),
                        busy: Calendar::default(),
                        last_touch: end,
                        written: 0,
                        last_writer: NO_OWNER,
                    },
                );
                end
            }
            Some(l) => {
                // A read landing between another CPU's writes (run earlier in simulation
                // order) fetched the line then, and that CPU's next write took it back.
                let late = l.owners.read(cpu, t, self.floor);
                let fetch = !l.sharers.contains(cpu) && l.owner() != NO_OWNER;
                let mut end = t;
                if fetch || late.is_some() {
                    self.stats.transfers += 1;
                    end = t.saturating_add(c.transfer);
                }
                if let Some(owes) = late {
                    // The writer kept its copy through the read (both shared it), so its next
                    // write upgraded the line: an invalidation, not a transfer.
                    let upgrade = c.invalidate;
                    self.stats.calendar_evictions += late_transfer(l, owes, upgrade, self.floor);
                    self.stats.late_transfers += 1;
                    self.owed.push((owes.0, upgrade));
                }
                l.sharers.insert(cpu);
                l.last_touch = l.last_touch.max(end);
                end
            }
        }
    }

    /// What fetching `line` from memory costs: a stream (the hardware prefetcher fetched it
    /// while the previous line was used) if the line before it in the same 4 KiB page is
    /// cached, as in a walk over a table or a bitmap; a full miss otherwise. Prefetchers do
    /// not cross 4 KiB pages, and keeping to a page keeps the result independent of where
    /// allocations land.
    fn miss_cost(&mut self, line: u64) -> u64 {
        self.stats.misses += 1;
        let in_page = line % (4096 / 64) != 0;
        if in_page && self.map.contains_key(&(line - 1)) {
            self.stats.streamed += 1;
            self.costs.dram_stream
        } else {
            self.costs.dram_miss
        }
    }

    /// After a spin wait on `line` saw another CPU's write: `cpu` loaded the line and holds a
    /// copy (its clock already counts the transfer).
    pub(crate) fn joined(&mut self, cpu: usize, line: u64) {
        if let Some(l) = self.map.get_mut(&line) {
            l.sharers.insert(cpu);
        }
    }

    /// Gives the line to `cpu` at `at` at no cost (a lock handed over: the hand-off cost
    /// includes the waiter's transfer of the lock word).
    pub(crate) fn take(&mut self, cpu: usize, at: u64, line: u64) {
        let l = self.map.entry(line).or_insert_with(|| Line {
            owners: Owners::default(),
            sharers: CpuSet::only(cpu),
            busy: Calendar::default(),
            last_touch: at,
            written: 0,
            last_writer: cpu,
        });
        // The lock model prices and serialises hand-overs (its calendar), so a hand-over
        // that lands inside another CPU's run of writes to the lock word owes nothing here.
        let _ = l.owners.write(cpu, at, self.floor);
        l.sharers = CpuSet::only(cpu);
        l.last_writer = cpu;
        l.last_touch = l.busy.last_end().max(at);
    }

    /// Forgets the lines of the freed block `[addr, addr + size)`: memory allocated there
    /// next starts cold, as anywhere else (`freed.rs`).
    pub(crate) fn forget(&mut self, addr: usize, size: usize) {
        let first = Lines::line_of(addr);
        let end = Lines::line_of(addr.saturating_add(size).saturating_add(63));
        if end.saturating_sub(first) > self.map.len() as u64 {
            self.map.retain(|&l, _| l < first || l >= end);
        } else {
            for l in first..end {
                self.map.remove(&l);
            }
        }
    }

    /// Forgets every line no request can still meet a busy interval of (`freed.rs`: more
    /// blocks freed between two hooks than were recorded).
    pub(crate) fn forget_idle(&mut self) {
        let floor = self.floor;
        self.map.retain(|_, l| l.busy.last_end() > floor);
    }

    /// Forgets lines untouched for `retention` before `now`; runs once per `retention` of
    /// virtual time, so its cost is amortised over the accesses of that time.
    fn sweep(&mut self, now: u64) {
        if now < self.next_sweep {
            return;
        }
        let keep_after = now.saturating_sub(self.costs.retention);
        self.map.retain(|_, l| l.last_touch >= keep_after);
        self.next_sweep = now.saturating_add(self.costs.retention);
    }

    pub(crate) fn stats(&self) -> LineStats {
        LineStats {
            lines: self.map.len() as u64,
            ..self.stats
        }
    }
}

/// The line is busy for the transfer another CPU's write at `owes.1` owed (a write that
/// arrived late took the line from it just before): later requests queue behind it, as they
/// would have behind the write had it paid the transfer when it ran. Returns the intervals
/// the calendar dropped.
fn late_transfer(l: &mut Line, owes: (usize, u64), transfer: u64, floor: u64) -> u64 {
    let (from, to) = (owes.1, owes.1.saturating_add(transfer));
    let evicted = l.busy.insert(from, to, true, floor);
    l.last_touch = l.last_touch.max(to);
    evicted
}

fn clear(s: &mut CpuSet, cpu: usize) {
    if let Some(w) = s.0.get_mut(cpu / 64) {
        *w &= !(1 << (cpu % 64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: LineCosts = LineCosts {
        rmw_local: 10,
        transfer: 100,
        invalidate: 7,
        dram_miss: 1000,
        dram_stream: 30,
        retention: 1_000_000,
    };

    #[test]
    fn rmws_serialise_and_transfer() {
        let mut l = Lines::new(C);
        assert_eq!(l.rmw(0, 0, 1), 1010); // miss
        assert_eq!(l.rmw(0, 2000, 1), 2010); // owned: local
                                             // Waits for free_at, transfers.
        assert_eq!(l.rmw(1, 2005, 1), 2010 + 110);
        // Asked in a gap, simulated late: it went first, taking the line from CPU 0, which
        // owned it then (its write at 1010) and so owes a transfer for its write at 2010.
        assert_eq!(l.rmw(1, 1500, 1), 1610);
        assert_eq!((l.pop_owed(), l.pop_owed()), (Some((0, 100)), None));
        assert_eq!(l.rmw(1, 1505, 1), 1620); // behind the one that went first, its own
        assert_eq!(l.rmw(1, 2100, 1), 2130); // the later interval still holds
        assert_eq!(l.stats().late_transfers, 1);
        assert_eq!(l.load(2, 3000, 1), 3100); // written by 1: transfer
        assert_eq!(l.load(2, 4000, 1), 4000); // already a sharer
        assert_eq!(l.load(3, 4000, 1), 4100);
        // 1 owns, 2 and 3 share: 1's RMW invalidates two copies.
        assert_eq!(l.rmw(1, 5000, 1), 5000 + 10 + 14);
    }

    /// The calibration's ping-pong, priced as it measures: a CPU that loaded the line another
    /// wrote (a transfer) and then writes it upgrades its copy (an invalidation); one that
    /// writes without a copy fetches the line (a transfer) and invalidates no one else.
    #[test]
    fn a_write_after_a_load_upgrades_and_one_without_a_copy_transfers() {
        let mut l = Lines::new(C);
        assert_eq!(l.rmw(0, 0, 1), 1010); // miss
        assert_eq!(l.load(1, 2000, 1), 2100); // written by 0: transfer
        assert_eq!(l.rmw(1, 2100, 1), 2100 + 10 + 7); // upgrade: 0's copy invalidated
        assert_eq!(l.stats().upgrades, 1);
        assert_eq!(l.rmw(0, 3000, 1), 3000 + 10 + 100); // no copy: transfer, no sharer left
        assert_eq!(l.stats().transfers, 2);
        // A third CPU's copy is invalidated beside the owner's.
        assert_eq!(l.load(1, 4000, 1), 4100);
        assert_eq!(l.load(2, 4000, 1), 4100);
        assert_eq!(l.rmw(1, 4100, 1), 4100 + 10 + 2 * 7);
    }

    /// A read that lands between another CPU's writes in virtual time (simulated after
    /// them) owes that CPU an upgrade for its next write: it kept a shared copy.
    #[test]
    fn a_late_read_owes_the_writer_an_upgrade() {
        let mut l = Lines::new(C);
        assert_eq!(l.rmw(0, 0, 1), 1010);
        assert_eq!(l.rmw(0, 2000, 1), 2010);
        assert_eq!(l.load(1, 1500, 1), 1600);
        assert_eq!((l.pop_owed(), l.pop_owed()), (Some((0, 7)), None));
        assert_eq!(l.stats().late_transfers, 1);
    }

    /// Guest data lines cost only their movement between CPUs: their memory access is
    /// `guest_access`, charged apart, so a line no cache holds adds no miss here.
    #[test]
    fn guest_data_lines_cost_only_their_transfers() {
        let mut l = Lines::new(C);
        assert_eq!(l.data_write(0, 0, 1), 0); // cold: no miss
        assert_eq!(l.data_write(0, 100, 1), 100); // owned
        assert_eq!(l.data_write(1, 200, 1), 300); // CPU 0's: a transfer
        assert_eq!(l.data_load(0, 400, 1), 500); // written by 1: a transfer
        assert_eq!(l.data_load(0, 600, 1), 600); // a sharer now
        assert_eq!(l.data_load(2, 700, 9), 700); // cold: no miss
        assert_eq!(l.stats().transfers, 2);
        // Other lines still pay their misses.
        assert_eq!(l.store(0, 800, 20), 1800);
    }

    #[test]
    fn a_store_to_an_owned_line_is_free() {
        let mut l = Lines::new(C);
        assert_eq!(l.rmw(0, 0, 1), 1010); // miss
        assert_eq!(l.store(0, 2000, 1), 2000); // owned: no locked instruction
        assert_eq!(l.store(1, 3000, 1), 3100); // another CPU's: a transfer
        assert_eq!(l.rmw(1, 4000, 1), 4010);
        assert_eq!(l.stats().stores, 2);
    }

    #[test]
    fn a_line_after_a_cached_one_in_its_page_is_streamed() {
        let mut l = Lines::new(C);
        assert_eq!(l.load(0, 0, 64), 1000); // first line of a page: a full miss
        assert_eq!(l.load(0, 1000, 65), 1030); // the next one: streamed
        assert_eq!(l.rmw(0, 2000, 66), 2000 + 10 + 30); // an RMW streams too
        assert_eq!(l.load(0, 3000, 68), 4000); // after a gap: a full miss
        assert_eq!(l.load(0, 4000, 127), 5000); // last line of the page, 126 not cached
        assert_eq!(l.load(0, 5000, 128), 6000); // 127 is, but prefetchers stop at pages
        assert_eq!(l.load(0, 6000, 129), 6030);
        let s = l.stats();
        assert_eq!((s.misses, s.streamed), (7, 3));
    }

    #[test]
    fn retention_forgets_untouched_lines() {
        let mut l = Lines::new(C);
        l.rmw(0, 0, 1);
        l.rmw(0, 0, 2);
        l.rmw(0, 1_500_000, 2); // sweep at 1.5 ms keeps lines touched after 0.5 ms: none
        assert_eq!(l.stats().lines, 1);
        assert_eq!(l.rmw(0, 1_600_000, 1), 1_600_000 + 1010); // a miss again
    }

    #[test]
    fn sets_ignore_out_of_range_cpus() {
        let mut s = CpuSet::default();
        s.insert(MAX_CPUS);
        assert_eq!(s.len(), 0);
        assert!(!s.contains(MAX_CPUS));
        s.insert(255);
        assert!(s.contains(255));
    }
}
