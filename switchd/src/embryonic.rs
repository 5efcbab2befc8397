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
//!   thread. An entry is reaped between `timeout` and `timeout` + one pass.
//! - Each candidate is read again just before it is deleted, so a handshake
//!   ACK that arrived since the walk read it keeps the flow. (What remains
//!   is the microsecond between that read and the delete; a Maglev flow hit
//!   by it is recovered on its next segment, on the same server while the
//!   pool is unchanged.)

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
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

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

#[derive(Debug)]
pub struct EmbryonicReaper {
    pub timeout: Duration,
    /// Entries read per step.
    pub budget: usize,
    cursor: FlowScanCursor,
    embryonic_this_pass: u64,
    batch: Vec<(CFlowKey, CFlow)>,
    pub metrics: EmbryonicMetrics,
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
        }
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
}
