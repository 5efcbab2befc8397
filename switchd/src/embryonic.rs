//! The embryonic-flow reaper: removes flow entries that saw a SYN and
//! nothing else from the client (port scans, SYN floods, clients that gave
//! up) once they are older than `embryonic_timeout_ms`, and their store
//! mappings with them. Without it such entries stay until the LRU evicts
//! them, and under a SYN flood the LRU evicts idle live connections first.
//!
//! Invariants:
//! - A flow is embryonic only while its entry has none of ESTABLISHED (the
//!   data plane sets it on the client's first non-SYN segment, and on
//!   entries it recovers from a non-SYN), MIGRATED, CLOSING or a FIN flag,
//!   has no migration-table entry, and was made by the data plane
//!   (`created_ns != 0`: entries restored from the store are never reaped).
//! - The walk is incremental and bounded: each [`EmbryonicReaper::step`]
//!   reads about `budget` entries (one syscall per 4,096) and goes on where
//!   the previous step stopped, so a huge table never stalls the control
//!   thread. An entry is reaped between `timeout` and `timeout` + one pass
//!   + [`PACE_GRAIN`].
//! - A pass runs only when one can find something: [`EmbryonicReaper::tick`]
//!   watches the data plane's `fwd_new_flow` counter (every entry the walk
//!   could reap was made by a SYN counted there) and starts a pass once the
//!   flows created in some [`PACE_GRAIN`] are `timeout` old, so at most one
//!   pass per grain, and none while no SYN arrives. A kernel walk costs in
//!   proportion to the table's buckets, not its entries (a sparse 2M-bucket
//!   table takes one ~7.5 ms syscall that holds a CPU), so walking every
//!   25 ms cost a third of a core for nothing.
//! - Each candidate is read again just before it is deleted, so a handshake
//!   ACK that arrived since the walk read it keeps the flow. (What remains
//!   is the microsecond between that read and the delete; a Maglev flow hit
//!   by it is recovered on its next segment, on the same server while the
//!   pool is unchanged.)

use std::collections::VecDeque;
use std::time::Duration;

use capybara_proto::FlowKey;

use crate::abi::*;
use crate::control::{FlowEventSink, FlowUpdate};
use crate::dataplane::{DataPlane, FlowScanCursor, Result};

/// Flags that make a flow not embryonic.
const NOT_EMBRYONIC: u16 =
    FLOW_ESTABLISHED | FLOW_MIGRATED | FLOW_CLOSING | FLOW_FIN_CLIENT | FLOW_FIN_SERVER;

/// Whether `flow` is an embryonic entry older than `timeout` at `now_ns`
/// (CLOCK_MONOTONIC, the data plane's `bpf_ktime_get_ns` clock).
pub fn is_stale_embryonic(flow: &CFlow, now_ns: u64, timeout: Duration) -> bool {
    flow.flags & NOT_EMBRYONIC == 0
        && flow.created_ns != 0
        && now_ns.saturating_sub(flow.created_ns) >= timeout.as_nanos() as u64
}

/// CLOCK_MONOTONIC now, in ns (the clock of `CFlow::created_ns`).
pub use capybara_proto::time::monotonic_ns;

/// Counters shown in `/status` (`embryonic`) and `/metrics`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EmbryonicMetrics {
    /// Flow entries read by the walk.
    pub scanned_total: u64,
    /// Embryonic flows removed (flow entry and store mapping).
    pub reaped_total: u64,
    /// Candidates that turned out established (or gone) on the second read.
    pub spared_total: u64,
    /// Complete passes over the flow table.
    pub passes_total: u64,
    /// Embryonic entries seen during the last complete pass (any age).
    pub embryonic_last_pass: u64,
}

/// New flows are dated to this grain; at most one pass starts per grain.
pub const PACE_GRAIN: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct EmbryonicReaper {
    pub timeout: Duration,
    /// Entries read per step.
    pub budget: usize,
    cursor: FlowScanCursor,
    embryonic_this_pass: u64,
    batch: Vec<(CFlowKey, CFlow)>,
    pub metrics: EmbryonicMetrics,
    /// Grains (CLOCK_MONOTONIC ns, multiples of [`PACE_GRAIN`]) in which
    /// new flows were seen that no pass has covered yet, oldest first; at
    /// most `timeout / PACE_GRAIN` + 2 entries.
    pending: VecDeque<u64>,
    /// The data plane's `fwd_new_flow` counter at the last tick.
    last_new_flows: Option<u64>,
    /// When the pass under way started.
    pass_start_ns: Option<u64>,
}

impl EmbryonicReaper {
    pub fn new(timeout: Duration, budget: usize) -> Self {
        EmbryonicReaper {
            timeout,
            budget: budget.max(1),
            cursor: FlowScanCursor::default(),
            embryonic_this_pass: 0,
            batch: Vec::new(),
            metrics: EmbryonicMetrics::default(),
            pending: VecDeque::new(),
            last_new_flows: None,
            pass_start_ns: None,
        }
    }

    /// Notes the data plane's new-flow counter at `now_ns`. The first
    /// reading counts as new flows (entries made before this process
    /// started get a pass too).
    pub fn note_new_flows(&mut self, counter: u64, now_ns: u64) {
        if self.last_new_flows == Some(counter) {
            return;
        }
        self.last_new_flows = Some(counter);
        let grain = PACE_GRAIN.as_nanos() as u64;
        let at = now_ns - now_ns % grain;
        if self.pending.back() != Some(&at) {
            self.pending.push_back(at);
        }
    }

    /// Whether a step should run at `now_ns`: a pass is under way, or the
    /// flows of the oldest pending grain are `timeout` old.
    pub fn due(&self, now_ns: u64) -> bool {
        let ripe = PACE_GRAIN.as_nanos() as u64 + self.timeout.as_nanos() as u64;
        self.pass_start_ns.is_some() || self.pending.front().is_some_and(|&at| at + ripe <= now_ns)
    }

    /// What the control loop calls every few ms: reads the new-flow counter
    /// (one map lookup) and runs a [`Self::step`] only when [`Self::due`].
    pub fn tick<D: DataPlane>(
        &mut self,
        dp: &mut D,
        now_ns: u64,
        sink: &mut dyn FlowEventSink,
    ) -> Result<usize> {
        let counter = dp.stat_counter(stat("fwd_new_flow"))?;
        self.note_new_flows(counter, now_ns);
        if !self.due(now_ns) {
            return Ok(0);
        }
        self.step(dp, now_ns, sink)
    }

    /// One bounded step of the walk at `now_ns`: stale embryonic flows are
    /// deleted from the data plane and reported to `sink` as closed (the
    /// store sink deletes their mappings). Returns how many were reaped.
    pub fn step<D: DataPlane>(
        &mut self,
        dp: &mut D,
        now_ns: u64,
        sink: &mut dyn FlowEventSink,
    ) -> Result<usize> {
        self.batch.clear();
        let pass_start = *self.pass_start_ns.get_or_insert(now_ns);
        let wrapped = dp.scan_flows(&mut self.cursor, self.budget, &mut self.batch)?;
        self.metrics.scanned_total += self.batch.len() as u64;
        let mut updates = Vec::new();
        for (key, flow) in &self.batch {
            if flow.flags & NOT_EMBRYONIC == 0 {
                self.embryonic_this_pass += 1;
            }
            if !is_stale_embryonic(flow, now_ns, self.timeout) {
                continue;
            }
            // Read again: the handshake ACK may have arrived since the walk.
            let fresh = dp.lookup_flow(*key)?;
            let still = fresh.is_some_and(|f| is_stale_embryonic(&f, now_ns, self.timeout));
            if !still || dp.lookup_migration(*key)?.is_some() {
                self.metrics.spared_total += 1;
                continue;
            }
            dp.delete_flow(*key)?;
            self.metrics.reaped_total += 1;
            updates.push(FlowUpdate {
                event: CFlowEvent {
                    key: *key,
                    kind: EV_CLOSED,
                    server: flow.server,
                    prev_server: flow.server,
                    ts_ns: now_ns,
                },
                key: FlowKey::from(*key),
                owner: None,
            });
        }
        if wrapped {
            // The pass saw every flow created `timeout` before it started.
            self.pass_start_ns = None;
            let ripe = PACE_GRAIN.as_nanos() as u64 + self.timeout.as_nanos() as u64;
            while self
                .pending
                .front()
                .is_some_and(|&at| at + ripe <= pass_start)
            {
                self.pending.pop_front();
            }
            self.metrics.passes_total += 1;
            self.metrics.embryonic_last_pass = self.embryonic_this_pass;
            self.embryonic_this_pass = 0;
        }
        if !updates.is_empty() {
            sink.write_batch(&updates);
        }
        Ok(updates.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::VecSink;
    use crate::dataplane::MemDataPlane;

    fn key(port: u16) -> CFlowKey {
        CFlowKey {
            client_ip: 0x0b00_12c6,
            service_ip: 0x0164_12c6,
            client_port: port.to_be(),
            service_port: 80u16.to_be(),
        }
    }

    #[test]
    fn only_old_embryonic_flows_without_migration_go() {
        const S: u64 = 1_000_000_000;
        let mut dp = MemDataPlane::new();
        let flow = |flags, created_ns| CFlow {
            server: 1,
            service: 0,
            flags,
            created_ns,
        };
        dp.flows.insert(key(1), flow(0, S)); // old SYN only: reaped
        dp.flows.insert(key(2), flow(FLOW_ESTABLISHED, S)); // established
        dp.flows.insert(key(3), flow(0, 9 * S)); // young SYN only
        dp.flows.insert(key(4), flow(FLOW_MIGRATED, S));
        dp.flows.insert(key(5), flow(FLOW_FIN_CLIENT, S));
        dp.flows.insert(key(6), flow(0, 0)); // restored by the control plane
        dp.flows.insert(key(7), flow(0, S)); // has a migration entry
        dp.migrations.insert(key(7), CMigration::owner(2, 1));
        let mut r = EmbryonicReaper::new(Duration::from_secs(5), 3);
        let mut sink = VecSink::default();
        // 7 entries, 3 per step: the third step ends the pass.
        let mut steps = 0;
        while r.metrics.passes_total == 0 {
            r.step(&mut dp, 10 * S, &mut sink).unwrap();
            steps += 1;
            assert!(steps <= 4, "a pass must end");
        }
        assert!(!dp.flows.contains_key(&key(1)));
        for p in 2..=7 {
            assert!(dp.flows.contains_key(&key(p)), "flow {p} kept");
        }
        assert_eq!(sink.0.len(), 1);
        assert_eq!((sink.0[0].key, sink.0[0].kind), (key(1), EV_CLOSED));
        assert_eq!(r.metrics.reaped_total, 1);
        assert_eq!(r.metrics.spared_total, 1, "the migrated one");
        assert!(!is_stale_embryonic(
            &flow(0, 9 * S),
            10 * S,
            Duration::from_secs(5)
        ));
        assert!(is_stale_embryonic(
            &flow(0, 5 * S),
            10 * S,
            Duration::from_secs(5)
        ));
    }

    #[test]
    fn passes_run_only_when_new_flows_are_old_enough() {
        const S: u64 = 1_000_000_000;
        let mut dp = MemDataPlane::new();
        let new_flows = stat("fwd_new_flow");
        let syn = |created_ns| CFlow {
            server: 1,
            service: 0,
            flags: 0,
            created_ns,
        };
        let mut r = EmbryonicReaper::new(Duration::from_secs(5), 4096);
        let mut sink = VecSink::default();
        // A SYN at 1.2 s: its grain (1 s) is ripe at 1 + 1 + 5 = 7 s.
        dp.flows.insert(key(1), syn(S + S / 5));
        dp.stat_counters[new_flows] = 1;
        for t in [S + S / 2, 3 * S, 6 * S, 7 * S - 1] {
            r.tick(&mut dp, t, &mut sink).unwrap();
        }
        assert_eq!(
            r.metrics.scanned_total, 0,
            "no walk before the grain is ripe"
        );
        r.tick(&mut dp, 7 * S, &mut sink).unwrap();
        assert_eq!((r.metrics.passes_total, r.metrics.reaped_total), (1, 1));
        // Nothing new: no more walks, however long it stays quiet.
        for t in 8..40 {
            r.tick(&mut dp, t * S, &mut sink).unwrap();
        }
        assert_eq!(r.metrics.passes_total, 1);
        // Another SYN at 40.5 s: one more pass at 46 s, not before.
        dp.flows.insert(key(2), syn(40 * S + S / 2));
        dp.stat_counters[new_flows] = 2;
        r.tick(&mut dp, 40 * S + S / 2, &mut sink).unwrap();
        r.tick(&mut dp, 45 * S, &mut sink).unwrap();
        assert_eq!(r.metrics.passes_total, 1);
        r.tick(&mut dp, 46 * S, &mut sink).unwrap();
        assert_eq!((r.metrics.passes_total, r.metrics.reaped_total), (2, 2));
        assert!(dp.flows.is_empty());
        // SYNs in every grain: at most one pass per grain.
        for t in 50..70 {
            dp.stat_counters[new_flows] += 1;
            r.tick(&mut dp, t * S, &mut sink).unwrap();
            r.tick(&mut dp, t * S + S / 2, &mut sink).unwrap();
        }
        assert!(r.metrics.passes_total - 2 <= 20 - 5, "{:?}", r.metrics);
    }
}
