//! Flow persistence: a [`FlowEventSink`] on the store's batching
//! [`FlowWriter`]. NEW / MIGRATED / RETURNED put the flow's owner, CLOSED
//! deletes it. `try_push` never blocks: when the writer's queue is full the
//! operation is refused and counted (a standby then recovers that flow by
//! Maglev, or loses it if it was migrated), never waited for.

use std::sync::Arc;

use capybara_store::{FlowOp, FlowWriter};

use crate::abi::*;
use crate::control::{FlowEventSink, FlowUpdate};

/// Counters of the sink itself; the writer has its own (batch sizes, lag).
#[derive(Debug, Default, Clone)]
pub struct SinkMetrics {
    pub puts: u64,
    pub deletes: u64,
    /// Refused by the writer (queue full or closed).
    pub overflow: u64,
    /// Events whose owner index is not a registered server (put as delete).
    pub unknown_owner: u64,
    /// Batches handed over by the control loop, and the largest.
    pub batches: u64,
    pub max_batch: u64,
}

pub struct StoreSink {
    writer: Arc<FlowWriter>,
    pub metrics: SinkMetrics,
}

impl StoreSink {
    pub fn new(writer: Arc<FlowWriter>) -> Self {
        StoreSink {
            writer,
            metrics: SinkMetrics::default(),
        }
    }
    pub fn writer(&self) -> &Arc<FlowWriter> {
        &self.writer
    }
}

/// The store operation for one flow event (`None`: nothing to write).
pub fn op_for(u: &FlowUpdate) -> Option<FlowOp> {
    match u.event.kind {
        EV_NEW | EV_MIGRATED | EV_RETURNED => Some(match u.owner {
            Some(server) => FlowOp::Put { key: u.key, server },
            None => FlowOp::Delete { key: u.key },
        }),
        EV_CLOSED => Some(FlowOp::Delete { key: u.key }),
        _ => None,
    }
}

impl FlowEventSink for StoreSink {
    fn write_batch(&mut self, events: &[FlowUpdate]) {
        self.metrics.batches += 1;
        self.metrics.max_batch = self.metrics.max_batch.max(events.len() as u64);
        for u in events {
            let Some(op) = op_for(u) else { continue };
            match op {
                FlowOp::Put { .. } => self.metrics.puts += 1,
                FlowOp::Delete { .. } => {
                    if u.event.kind != EV_CLOSED {
                        self.metrics.unknown_owner += 1;
                    }
                    self.metrics.deletes += 1
                }
            }
            if self.writer.try_push(op).is_err() {
                self.metrics.overflow += 1;
            }
        }
    }
}

/// Flow updates held back while this switchd serves without holding the
/// leader lease (HA: it lost the lease in a store outage and is trying to
/// win it back): writing them could overwrite what a newer leader wrote.
/// Replayed into the store sink when the lease is won back, dropped when
/// the switchd steps down. Bounded: beyond `cap` the oldest are dropped and
/// counted (a standby then recovers those flows by Maglev).
#[derive(Debug, Default)]
pub struct HeldUpdates {
    pub updates: std::collections::VecDeque<FlowUpdate>,
    pub cap: usize,
    pub dropped: u64,
}

impl HeldUpdates {
    pub fn new(cap: usize) -> Self {
        HeldUpdates {
            updates: Default::default(),
            cap: cap.max(1),
            dropped: 0,
        }
    }
    /// Hands everything held to `sink` in batches of 4,096.
    pub fn replay(&mut self, sink: &mut dyn FlowEventSink) -> usize {
        let all: Vec<FlowUpdate> = self.updates.drain(..).collect();
        for chunk in all.chunks(4096) {
            sink.write_batch(chunk);
        }
        all.len()
    }
}

impl FlowEventSink for HeldUpdates {
    fn write_batch(&mut self, events: &[FlowUpdate]) {
        for u in events {
            if self.updates.len() >= self.cap {
                self.updates.pop_front();
                self.dropped += 1;
            }
            self.updates.push_back(*u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{ControlConfig, ControlPlane, TargetPolicy};
    use crate::dataplane::MemDataPlane;
    use capybara_proto::{FlowKey, Instant, ServerId};
    use capybara_store::{FlowWriterConfig, SqliteConfig, SqliteStore, Store};
    use std::net::Ipv4Addr;
    use std::time::Duration;

    #[test]
    fn held_updates_are_bounded_and_replayed_in_order() {
        let u = |port: u16| FlowUpdate {
            event: CFlowEvent {
                kind: EV_NEW,
                ..Default::default()
            },
            key: key(port),
            owner: Some(ServerId(1)),
        };
        let mut h = HeldUpdates::new(3);
        h.write_batch(&[u(1), u(2)]);
        h.write_batch(&[u(3), u(4)]);
        assert_eq!(h.dropped, 1);
        let mut out = crate::control::VecSink::default();
        assert_eq!(h.replay(&mut out), 3);
        assert!(h.updates.is_empty());
        assert_eq!(out.0.len(), 3);
    }

    fn key(port: u16) -> FlowKey {
        FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: port,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        }
    }

    /// Real SQLite store, real writer: events from the control plane end up
    /// as flow mappings; closed flows disappear; migrated flows follow their
    /// target; linger reaps the closed flow's migration entry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn flow_events_become_store_mappings_and_closed_entries_are_reaped() {
        let dir = std::env::temp_dir().join(format!("capy-switchd-persist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store: Arc<dyn Store> = Arc::new(
            SqliteStore::open(SqliteConfig::at(dir.join("s.db")))
                .await
                .unwrap(),
        );
        let writer = Arc::new(FlowWriter::spawn(
            store.clone(),
            FlowWriterConfig::default(),
        ));
        let mut sink = StoreSink::new(writer.clone());

        let mut cfg = ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin);
        cfg.closed_linger = Duration::from_millis(100);
        let mut c = ControlPlane::new(MemDataPlane::new(), cfg);
        c.add_service(
            Ipv4Addr::new(198, 18, 100, 1),
            80,
            crate::control::Placement::Maglev,
        )
        .unwrap();
        for j in 1..=2u32 {
            c.register(
                Instant::ZERO,
                ServerId(j),
                Ipv4Addr::new(198, 18, 2, 10 + j as u8),
                [2, 0, 0, 0, 0, j as u8],
                3,
                [2; 6],
                1,
            )
            .unwrap();
        }
        let k1 = CFlowKey::from(key(1));
        let k2 = CFlowKey::from(key(2));
        c.dp.place_flow(k1, 0, 0);
        c.dp.place_flow(k2, 0, 0);
        c.dp.migrate_flow(k2, 1);
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        writer.flush(Duration::from_secs(5)).await.unwrap();
        assert_eq!(store.get_flow(&key(1)).await.unwrap(), Some(ServerId(1)));
        assert_eq!(store.get_flow(&key(2)).await.unwrap(), Some(ServerId(2)));

        // Client FIN on the migrated flow: the data plane marks it closing
        // and reports it; the store forgets it; after the linger the
        // control plane removes both entries.
        c.dp.flows.get_mut(&k2).unwrap().flags |= FLOW_CLOSING;
        c.dp.events.push_back(CFlowEvent {
            key: k2,
            kind: EV_CLOSED,
            server: 1,
            prev_server: 1,
            ts_ns: 0,
        });
        c.flush_events(Instant::from_millis(10), &mut sink).unwrap();
        writer.flush(Duration::from_secs(5)).await.unwrap();
        assert_eq!(store.get_flow(&key(2)).await.unwrap(), None);
        c.heartbeat(Instant::from_millis(50), ServerId(1)).unwrap();
        c.heartbeat(Instant::from_millis(50), ServerId(2)).unwrap();
        c.tick(Instant::from_millis(50)).unwrap();
        assert!(c.dp.migrations.contains_key(&k2), "still lingering");
        c.tick(Instant::from_millis(120)).unwrap();
        assert!(
            !c.dp.migrations.contains_key(&k2) && !c.dp.flows.contains_key(&k2),
            "reaped"
        );
        assert!(c.dp.flows.contains_key(&k1), "open flow untouched");
        assert_eq!(c.reaped_total, 1);

        assert_eq!(
            (
                sink.metrics.puts,
                sink.metrics.deletes,
                sink.metrics.overflow
            ),
            (3, 1, 0)
        );
        let m = writer.metrics();
        assert_eq!(m.written_total, 4);
        assert!(m.batches_total >= 1 && m.batches_total <= 4);
        writer.close(Duration::from_secs(5)).await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
