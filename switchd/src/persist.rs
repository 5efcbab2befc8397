//! Persistence: a [`FlowEventSink`] on the store's batching
//! [`FlowWriter`], and the server record a registration is stored as.
//!
//! Flows: NEW / MIGRATED / RETURNED put the flow's owner, CLOSED deletes
//! it. `try_push` never blocks: when the writer's queue is full the
//! operation is refused and counted (a standby then recovers that flow by
//! Maglev, or loses it if it was migrated), never waited for.
//!
//! Servers: [`server_record`] is what a REGISTER writes (through
//! `Store::put_registered_server`, which keeps an operator's weight) and
//! [`restored_registration`] what a switch that takes over registers from
//! it, so that the restored server is the one the REGISTER made, instance
//! id included: its next REGISTER is judged a restart or not as it would
//! have been by the switch that took the first one.

use std::net::SocketAddr;
use std::sync::Arc;

use capybara_store::{FlowOp, FlowWriter};

use crate::abi::*;
use crate::control::{FlowEventSink, FlowUpdate, Registration};

/// The store record of a server that registered as `reg` from `mgmt` with
/// a REGISTER of seq `register_seq` (kept only with an instance id, which
/// is what makes seqs continue across restarts) listing `services`.
pub fn server_record(
    reg: &Registration,
    mgmt: SocketAddr,
    register_seq: u64,
    services: &[std::net::SocketAddrV4],
) -> capybara_store::Server {
    let mut rec = capybara_store::Server::new(reg.id, format!("s{}", reg.id.0), mgmt, reg.data_ip);
    rec.data_mac = Some(crate::sys::format_mac(&reg.mac));
    rec.services = services.to_vec();
    rec.weight = reg.weight.max(1);
    if reg.instance != 0 {
        rec.instance = Some(reg.instance);
        rec.register_seq = Some(register_seq);
    }
    rec
}

/// The weights an operator set (`weight_set`) in server records `servers`.
pub fn operator_weights(
    servers: &[capybara_store::Server],
) -> std::collections::BTreeMap<capybara_proto::ServerId, u32> {
    servers
        .iter()
        .filter(|s| s.weight_set)
        .map(|s| (s.id, s.weight))
        .collect()
}

/// What stored server `rec` registers as on a takeover, reached through
/// this switch's interface `ifindex` (Ethernet address `src_mac`) at `mac`
/// (the record's `data_mac`). A record without an instance id (an older
/// hostagent, or written before records had one) restores 0: the next
/// REGISTER cannot be told a restart and its flows are kept.
pub fn restored_registration(
    rec: &capybara_store::Server,
    mac: [u8; 6],
    ifindex: u32,
    src_mac: [u8; 6],
) -> Registration {
    Registration {
        id: rec.id,
        data_ip: rec.data_addr,
        mac,
        ifindex,
        src_mac,
        weight: rec.weight.max(1),
        instance: rec.instance.unwrap_or(0),
    }
}

/// The control-channel seq a switch that takes over expects messages from
/// stored server `rec` to be above (0: no floor), as the switch that took
/// its REGISTER does: the REGISTER's seq, raised by the stored `floor` (the
/// last seq the active accepted, written every few seconds) when that is of
/// the same process. Only with an instance id: without one, seqs restart
/// with the process.
pub fn restored_seq_floor(
    rec: &capybara_store::Server,
    floor: Option<&capybara_store::SeqFloor>,
) -> u64 {
    let Some(instance) = rec.instance else {
        return 0;
    };
    let accepted = floor
        .filter(|f| f.server == rec.id && f.instance == instance)
        .map_or(0, |f| f.seq);
    rec.register_seq.unwrap_or(0).max(accepted)
}

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

    /// A fresh SQLite store in a temp dir named after `test` (removed by
    /// the caller).
    async fn sqlite_store(test: &str) -> (std::path::PathBuf, Arc<dyn Store>) {
        let dir = std::env::temp_dir().join(format!("capy-switchd-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = SqliteStore::open(SqliteConfig::at(dir.join("s.db")))
            .await
            .unwrap();
        (dir, Arc::new(store))
    }

    /// An operator's weight in a real SQLite store survives the REGISTER
    /// record written over it, and is what `operator_weights` reads; a
    /// record whose weight is the REGISTER's names none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_register_record_keeps_the_operators_weight() {
        use std::net::SocketAddr;
        let (dir, store) = sqlite_store("weights").await;
        let reg = crate::control::tests::reg;
        let mgmt = SocketAddr::from(([198, 18, 1, 11], 40000));
        for j in [1, 2] {
            store
                .put_server(&server_record(&reg(j, 7), mgmt, 1, &[]))
                .await
                .unwrap();
        }
        assert!(operator_weights(&store.list_servers().await.unwrap()).is_empty());
        store.set_server_weight(ServerId(1), 0).await.unwrap();
        // s1 registers again (hostagent restart: config weight 1).
        let rec = server_record(&reg(1, 8), mgmt, 2, &[]);
        assert_eq!((rec.weight, rec.weight_set), (1, false));
        let written = store.put_registered_server(&rec).await.unwrap();
        let got = store.get_server(ServerId(1)).await.unwrap().unwrap();
        assert_eq!(written, got);
        assert_eq!(
            (
                got.weight,
                got.weight_set,
                got.register_weight,
                got.instance
            ),
            (0, true, Some(1), Some(8))
        );
        let w = operator_weights(&store.list_servers().await.unwrap());
        assert_eq!(w, [(ServerId(1), 0)].into());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The takeover path through a real SQLite store: a switch registers s1
    /// (instance 7) and s2 (no instance id, an older hostagent), stores
    /// their records and flows; a second control plane restores them as
    /// `sync_from_store` does. s1 registering as another instance then
    /// loses its old flows at once, as the same instance it keeps them; s2
    /// keeps them either way. A record in the format before instance ids
    /// (no such field) restores 0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_takeover_restores_instance_ids_from_the_store() {
        use crate::control::Placement;
        use std::net::SocketAddr;
        let (dir, store) = sqlite_store("takeover").await;
        let vip = Ipv4Addr::new(198, 18, 100, 1);
        let reg = crate::control::tests::reg;
        let mgmt = |j: u32| SocketAddr::from(([198, 18, 1, 10 + j as u8], 40000));
        let plane = || {
            let cfg = ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin);
            let mut c = ControlPlane::new(MemDataPlane::new(), cfg);
            c.add_service(vip, 80, Placement::Maglev).unwrap();
            c
        };

        // s1's REGISTER also lists a service whose pool is only the
        // servers that serve it.
        let cache = std::net::SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 4), 6379);
        let web = std::net::SocketAddrV4::new(vip, 80);
        let lists = |j: u32| if j == 1 { vec![web, cache] } else { vec![] };
        let mut active = plane();
        for (j, instance, seq) in [(1, 7, 1_000), (2, 0, 5)] {
            active
                .register_as(Instant::ZERO, &reg(j, instance), &lists(j))
                .unwrap();
            store
                .put_server(&server_record(&reg(j, instance), mgmt(j), seq, &lists(j)))
                .await
                .unwrap();
        }
        let writer = Arc::new(FlowWriter::spawn(
            store.clone(),
            FlowWriterConfig::default(),
        ));
        let mut sink = StoreSink::new(writer.clone());
        active.dp.place_flow(CFlowKey::from(key(1)), 0, 0);
        active.dp.place_flow(CFlowKey::from(key(2)), 1, 0);
        active.flush_events(Instant::ZERO, &mut sink).unwrap();
        writer.flush(Duration::from_secs(5)).await.unwrap();

        let recs = store.list_servers().await.unwrap();
        // The REGISTER's list comes back in its order (heartbeat health
        // bits are positions in it).
        assert_eq!(
            recs.iter().map(|r| r.services.clone()).collect::<Vec<_>>(),
            vec![vec![web, cache], vec![]]
        );
        assert_eq!(
            recs.iter()
                .map(|r| (r.instance, restored_seq_floor(r, None)))
                .collect::<Vec<_>>(),
            vec![(Some(7), 1_000), (None, 0)]
        );
        // The active's later floor raises it, for the same process only.
        let floor = |instance, seq| capybara_store::SeqFloor {
            server: ServerId(1),
            instance,
            seq,
        };
        let s1 = recs.iter().find(|r| r.id == ServerId(1)).unwrap();
        assert_eq!(restored_seq_floor(s1, Some(&floor(7, 5_000))), 5_000);
        assert_eq!(restored_seq_floor(s1, Some(&floor(7, 10))), 1_000);
        assert_eq!(restored_seq_floor(s1, Some(&floor(6, 5_000))), 1_000);
        let flows: Vec<(FlowKey, ServerId)> = store
            .scan_flows()
            .await
            .unwrap()
            .iter()
            .map(|m| (m.key, m.server))
            .collect();
        let take_over = || {
            let mut c = plane();
            for r in &recs {
                let mac = crate::sys::parse_mac(r.data_mac.as_deref().unwrap()).unwrap();
                let restored = restored_registration(r, mac, 5, [2; 6]);
                assert_eq!(restored, reg(r.id.0, r.instance.unwrap_or(0)));
                c.register_as(Instant::ZERO, &restored, &r.services)
                    .unwrap();
            }
            assert_eq!(c.server(ServerId(1)).unwrap().wanted, [web, cache]);
            assert_eq!(c.load_flows(&flows).unwrap(), (2, 0));
            c
        };
        let owner = |c: &ControlPlane<MemDataPlane>, p| c.dp.current_owner(CFlowKey::from(key(p)));

        let mut c = take_over();
        c.register_as(Instant::from_millis(10), &reg(1, 8), &[])
            .unwrap();
        c.register_as(Instant::from_millis(10), &reg(2, 9), &[])
            .unwrap();
        assert_eq!((owner(&c, 1), owner(&c, 2)), (None, Some(1)));
        assert_eq!(c.liveness.restarts_total, 1);

        let mut c = take_over();
        c.register_as(Instant::from_millis(10), &reg(1, 7), &[])
            .unwrap();
        assert_eq!((owner(&c, 1), owner(&c, 2)), (Some(0), Some(1)));
        assert_eq!(c.liveness.restarts_total, 0);

        // A record as written before instance ids.
        let old: capybara_store::Server = serde_json::from_str(
            r#"{"id":3,"name":"s3","mgmt_addr":"198.18.1.13:40000","data_addr":"198.18.2.13",
                "state":"active","weight":1,"registered_unix_ms":1,"updated_unix_ms":1,
                "data_mac":"02:00:00:00:00:03"}"#,
        )
        .unwrap();
        assert_eq!(restored_registration(&old, [2; 6], 3, [2; 6]).instance, 0);
        assert_eq!(restored_seq_floor(&old, None), 0);
        writer.close(Duration::from_secs(5)).await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Real SQLite store, real writer: events from the control plane end up
    /// as flow mappings; closed flows disappear; migrated flows follow their
    /// target; linger reaps the closed flow's migration entry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn flow_events_become_store_mappings_and_closed_entries_are_reaped() {
        let (dir, store) = sqlite_store("persist").await;
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
