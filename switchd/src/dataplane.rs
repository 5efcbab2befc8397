//! The seam between the control plane and a packet-forwarding backend.
//!
//! A `DataPlane` only stores what it is told and reports counters and flow
//! events: every decision (Maglev slots, LWRR and target rings, liveness
//! states) is made by the control plane and pushed as deltas. Backends: the
//! eBPF/XDP one (`crate::bpf`) and [`MemDataPlane`] for unit tests.

use std::collections::{HashMap, VecDeque};

use crate::abi::*;

#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    #[error("map {map}: {op} failed: {detail}")]
    Map {
        map: &'static str,
        op: &'static str,
        detail: String,
    },
    #[error("{what} {value} out of range (max {max})")]
    OutOfRange {
        what: &'static str,
        value: u32,
        max: u32,
    },
    #[error("loading the XDP program: {0}")]
    Load(String),
}

pub type Result<T> = std::result::Result<T, DataPlaneError>;

pub(crate) fn check_range(what: &'static str, value: u32, max: u32) -> Result<()> {
    if value >= max {
        return Err(DataPlaneError::OutOfRange { what, value, max });
    }
    Ok(())
}

/// Where a migration entry pending toward `dead` (a server whose entries
/// are being removed) goes instead ([`DataPlane::remove_flows_of`]): back
/// to the migration's origin (its id's high 32 bits are the origin's data
/// address), final, when `server_at(data address in network order)` names
/// another server, LIVE or DRAINING (`(index, state)`). By then the origin
/// resumed the connection (it was not sending its snapshot yet), or gave it
/// up as `Lost` after `in_doubt_limit` and resets the client's next segment:
/// either way it is the one owner, and the target that never answered is
/// dead. `None`: not pending, or no live origin (the entry is removed).
pub(crate) fn pending_back_to_origin(
    m: &CMigration,
    dead: u32,
    server_at: impl Fn(u32) -> Option<(u32, u8)>,
) -> Option<u32> {
    if m.server != dead || m.pending != MIG_PENDING {
        return None;
    }
    let origin = std::net::Ipv4Addr::from((m.migration_id >> 32) as u32);
    let (index, state) = server_at(u32::from_ne_bytes(origin.octets()))?;
    (index != dead && matches!(state, SERVER_LIVE | SERVER_DRAINING)).then_some(index)
}

/// A flow event from the data plane (decoded `struct capy_flow_event`).
pub type FlowEvent = CFlowEvent;

/// Where an incremental walk of the flow table stands
/// ([`DataPlane::scan_flows`]). A fresh cursor starts at the beginning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowScanCursor {
    /// Backend-specific position (the kernel's batch token for the BPF
    /// maps, an index for the in-memory backend); `None`: start of a pass.
    pub(crate) pos: Option<u64>,
}

pub trait DataPlane {
    fn set_config(&mut self, cfg: CConfig) -> Result<()>;
    fn set_iface(&mut self, ifindex: u32, iface: CIface) -> Result<()>;
    /// Writes server slot `index` and its data-address entry.
    fn set_server(&mut self, index: u32, server: CServer) -> Result<()>;
    /// Empties server slot `index` and forgets `data_ip` (network order).
    fn clear_server(&mut self, index: u32, data_ip: u32) -> Result<()>;
    fn set_service(&mut self, key: CServiceKey, svc: CService) -> Result<()>;
    fn remove_service(&mut self, key: CServiceKey) -> Result<()>;
    /// Writes `(slot, server)` pairs of service `service`'s Maglev table.
    fn write_maglev(&mut self, service: u32, delta: &[(u32, u32)]) -> Result<()>;
    /// Replaces ring `kind` (RING_PLACEMENT / RING_TARGET) of a service.
    fn write_ring(&mut self, service: u32, kind: u32, ring: &CRing) -> Result<()>;
    /// Monotonic packets forwarded to each server index (summed over CPUs).
    fn server_packets(&mut self) -> Result<Vec<u64>>;
    /// Of those, the packets that carried TCP payload (request packets):
    /// the pool monitor's load. Defaults to every packet (in-memory data
    /// planes count requests only).
    fn server_request_packets(&mut self) -> Result<Vec<u64>> {
        self.server_packets()
    }
    /// Reason counters, indexed like [`STAT_NAMES`].
    fn stats(&mut self) -> Result<Vec<u64>>;
    /// One stat counter (`crate::abi::stat`), summed over CPUs.
    fn stat_counter(&mut self, idx: usize) -> Result<u64> {
        Ok(self.stats()?.get(idx).copied().unwrap_or(0))
    }
    fn insert_flow(&mut self, key: CFlowKey, flow: CFlow) -> Result<()>;
    fn insert_migration(&mut self, key: CFlowKey, m: CMigration) -> Result<()>;
    fn delete_migration(&mut self, key: CFlowKey) -> Result<()>;
    fn delete_flow(&mut self, key: CFlowKey) -> Result<()>;
    /// Bulk insert (takeover): backends override with a batched syscall.
    fn insert_flows(&mut self, flows: &[(CFlowKey, CFlow)]) -> Result<()> {
        for (k, f) in flows {
            self.insert_flow(*k, *f)?;
        }
        Ok(())
    }
    /// Entries in the flow and migration tables (walks the maps: status
    /// only, not per packet).
    fn table_sizes(&mut self) -> Result<(usize, usize)>;
    fn lookup_flow(&mut self, key: CFlowKey) -> Result<Option<CFlow>>;
    fn lookup_migration(&mut self, key: CFlowKey) -> Result<Option<CMigration>>;
    /// The last migration id (newest in serial-number arithmetic) the
    /// program saw in a PREPARE from the registered origin `origin` (its
    /// data address): what REGISTER_ACK tells a registering server, so that
    /// a restarted hostagent numbers its migrations above it. `None`: none
    /// remembered (this program started since, or the backend keeps none).
    fn last_migration_id(&mut self, origin: std::net::Ipv4Addr) -> Result<Option<u64>> {
        let _ = origin;
        Ok(None)
    }
    /// Removes every flow currently owned by `server` (migration entries to
    /// it, and flow entries placed on it that did not migrate away).
    /// Returns the removed keys. Flows owned by other servers are untouched.
    /// A migration still pending toward `server` whose origin is a live
    /// server is not removed: it becomes final on its origin
    /// ([`pending_back_to_origin`]; not in the returned keys).
    fn remove_flows_of(&mut self, server: u32) -> Result<Vec<CFlowKey>>;
    /// Removes every flow and migration entry of service `key` (a service
    /// removed at run time). Returns the removed keys with their owner
    /// (the migration entry's server where there is one).
    fn remove_flows_of_service(&mut self, key: CServiceKey) -> Result<Vec<(CFlowKey, u32)>>;
    /// Moves pending flow events into `out`; never blocks.
    fn drain_events(&mut self, out: &mut Vec<FlowEvent>) -> Result<usize>;
    /// Appends up to about `budget` flow-table entries to `out`, continuing
    /// where `cursor` stopped (a bounded step of an incremental walk; the
    /// table may change meanwhile, so an entry can be missed or seen twice
    /// in one pass). Returns true when the pass reached the end (the cursor
    /// is then back at the start).
    fn scan_flows(
        &mut self,
        cursor: &mut FlowScanCursor,
        budget: usize,
        out: &mut Vec<(CFlowKey, CFlow)>,
    ) -> Result<bool>;
}

/// In-memory data plane: the maps as hash maps, plus hooks for tests to
/// play the packet path's part (counting, events).
#[derive(Debug, Default)]
pub struct MemDataPlane {
    pub config: CConfig,
    pub ifaces: HashMap<u32, CIface>,
    pub servers: HashMap<u32, CServer>,
    pub server_by_addr: HashMap<u32, u32>,
    pub services: HashMap<CServiceKey, CService>,
    pub maglev: HashMap<u32, Vec<u32>>,
    pub rings: HashMap<(u32, u32), CRing>,
    pub flows: HashMap<CFlowKey, CFlow>,
    pub migrations: HashMap<CFlowKey, CMigration>,
    pub packets: Vec<u64>,
    pub stat_counters: Vec<u64>,
    pub events: VecDeque<FlowEvent>,
    /// Maglev slots written so far (tests assert deltas stay small).
    pub maglev_writes: u64,
    /// Times a server became DRAINING here while a Maglev slot still named
    /// it (the real program drops such a slot's SYNs: `drop_no_server`).
    pub draining_while_placed: u64,
    /// Times a service was marked `SVC_REFUSE` here while its tables still
    /// placed new flows (a Maglev slot or the placement ring naming a LIVE
    /// server): the flag must follow the tables, never lead them.
    pub refuse_while_placeable: u64,
}

impl MemDataPlane {
    pub fn new() -> Self {
        MemDataPlane {
            packets: vec![0; MAX_SERVERS as usize],
            stat_counters: vec![0; STAT_MAX as usize],
            ..Default::default()
        }
    }
    /// Plays the packet path: `n` packets forwarded to `server`.
    pub fn count_packets(&mut self, server: u32, n: u64) {
        if let Some(c) = self.packets.get_mut(server as usize) {
            *c += n;
        }
    }
    /// Plays the packet path: a flow placed on `server`, with its event.
    pub fn place_flow(&mut self, key: CFlowKey, server: u32, service: u16) {
        self.flows.insert(
            key,
            CFlow {
                server,
                service,
                flags: 0,
                created_ns: 0,
            },
        );
        self.events.push_back(CFlowEvent {
            key,
            kind: EV_NEW,
            server,
            prev_server: server,
            ts_ns: 0,
        });
    }
    /// Plays a completed migration passing through (PREPARE-ACK, then
    /// CONN_STATE_ACK): a final entry on `target` and its event.
    pub fn migrate_flow(&mut self, key: CFlowKey, target: u32) {
        let prev = self.current_owner(key).unwrap_or(target);
        let id = self
            .migrations
            .get(&key)
            .map(|m| m.migration_id + 1)
            .unwrap_or(1);
        self.migrations.insert(key, CMigration::owner(target, id));
        let kind = if self.flows.get(&key).is_some_and(|f| f.server == target) {
            EV_RETURNED
        } else {
            EV_MIGRATED
        };
        self.events.push_back(CFlowEvent {
            key,
            kind,
            server: target,
            prev_server: prev,
            ts_ns: 0,
        });
    }
    pub fn current_owner(&self, key: CFlowKey) -> Option<u32> {
        self.migrations
            .get(&key)
            .map(|m| m.server)
            .or_else(|| self.flows.get(&key).map(|f| f.server))
    }
    /// The server a new flow of `service` would be placed on by Maglev.
    pub fn maglev_lookup(&self, service: u32, hash: u32) -> Option<u32> {
        let t = self.maglev.get(&service)?;
        let v = *t.get((hash % MAGLEV_SIZE) as usize)?;
        (v != NO_SERVER).then_some(v)
    }
}

impl DataPlane for MemDataPlane {
    fn set_config(&mut self, cfg: CConfig) -> Result<()> {
        self.config = cfg;
        Ok(())
    }
    fn set_iface(&mut self, ifindex: u32, iface: CIface) -> Result<()> {
        self.ifaces.insert(ifindex, iface);
        Ok(())
    }
    fn set_server(&mut self, index: u32, server: CServer) -> Result<()> {
        check_range("server index", index, MAX_SERVERS)?;
        if server.state == SERVER_DRAINING && self.maglev.values().any(|t| t.contains(&index)) {
            self.draining_while_placed += 1;
        }
        self.servers.insert(index, server);
        self.server_by_addr.insert(server.data_ip, index);
        Ok(())
    }
    fn clear_server(&mut self, index: u32, data_ip: u32) -> Result<()> {
        check_range("server index", index, MAX_SERVERS)?;
        self.servers.remove(&index);
        self.server_by_addr.remove(&data_ip);
        Ok(())
    }
    fn set_service(&mut self, key: CServiceKey, svc: CService) -> Result<()> {
        check_range("service index", svc.index, MAX_SERVICES)?;
        if svc.flags & SVC_REFUSE != 0 {
            let live = |i: &u32| self.servers.get(i).is_some_and(|s| s.state == SERVER_LIVE);
            let maglev = self
                .maglev
                .get(&svc.index)
                .is_some_and(|t| t.iter().any(live));
            let ring = self
                .rings
                .get(&(svc.index, RING_PLACEMENT))
                .is_some_and(|r| r.as_slice().iter().any(live));
            if maglev || ring {
                self.refuse_while_placeable += 1;
            }
        }
        self.services.insert(key, svc);
        Ok(())
    }
    fn remove_service(&mut self, key: CServiceKey) -> Result<()> {
        self.services.remove(&key);
        Ok(())
    }
    fn write_maglev(&mut self, service: u32, delta: &[(u32, u32)]) -> Result<()> {
        check_range("service index", service, MAX_SERVICES)?;
        let t = self
            .maglev
            .entry(service)
            .or_insert_with(|| vec![NO_SERVER; MAGLEV_SIZE as usize]);
        for (slot, v) in delta {
            check_range("maglev slot", *slot, MAGLEV_SIZE)?;
            t[*slot as usize] = *v;
        }
        self.maglev_writes += delta.len() as u64;
        Ok(())
    }
    fn write_ring(&mut self, service: u32, kind: u32, ring: &CRing) -> Result<()> {
        check_range("service index", service, MAX_SERVICES)?;
        check_range("ring kind", kind, RING_KINDS)?;
        self.rings.insert((service, kind), *ring);
        Ok(())
    }
    fn server_packets(&mut self) -> Result<Vec<u64>> {
        Ok(self.packets.clone())
    }
    fn stats(&mut self) -> Result<Vec<u64>> {
        Ok(self.stat_counters.clone())
    }
    fn insert_flow(&mut self, key: CFlowKey, flow: CFlow) -> Result<()> {
        self.flows.insert(key, flow);
        Ok(())
    }
    fn insert_migration(&mut self, key: CFlowKey, m: CMigration) -> Result<()> {
        self.migrations.insert(key, m);
        Ok(())
    }
    fn delete_migration(&mut self, key: CFlowKey) -> Result<()> {
        self.migrations.remove(&key);
        Ok(())
    }
    fn delete_flow(&mut self, key: CFlowKey) -> Result<()> {
        self.flows.remove(&key);
        Ok(())
    }
    fn table_sizes(&mut self) -> Result<(usize, usize)> {
        Ok((self.flows.len(), self.migrations.len()))
    }
    fn lookup_flow(&mut self, key: CFlowKey) -> Result<Option<CFlow>> {
        Ok(self.flows.get(&key).copied())
    }
    fn lookup_migration(&mut self, key: CFlowKey) -> Result<Option<CMigration>> {
        Ok(self.migrations.get(&key).copied())
    }
    fn remove_flows_of(&mut self, server: u32) -> Result<Vec<CFlowKey>> {
        let server_at = |ip: u32| {
            let i = *self.server_by_addr.get(&ip)?;
            Some((i, self.servers.get(&i)?.state))
        };
        let back: Vec<(CFlowKey, CMigration)> = self
            .migrations
            .iter()
            .filter_map(|(k, m)| {
                let o = pending_back_to_origin(m, server, server_at)?;
                Some((*k, CMigration::owner(o, m.migration_id)))
            })
            .collect();
        self.migrations.extend(back);
        let mut removed: Vec<CFlowKey> = self
            .migrations
            .iter()
            .filter(|(_, m)| m.server == server)
            .map(|(k, _)| *k)
            .collect();
        for k in &removed {
            self.migrations.remove(k);
            self.flows.remove(k);
        }
        let stay: Vec<CFlowKey> = self
            .flows
            .iter()
            .filter(|(k, f)| f.server == server && !self.migrations.contains_key(k))
            .map(|(k, _)| *k)
            .collect();
        for k in &stay {
            self.flows.remove(k);
        }
        removed.extend(stay);
        Ok(removed)
    }
    fn remove_flows_of_service(&mut self, key: CServiceKey) -> Result<Vec<(CFlowKey, u32)>> {
        let of = |k: &CFlowKey| k.service_ip == key.vip && k.service_port == key.port;
        let mut removed: Vec<(CFlowKey, u32)> = self
            .flows
            .iter()
            .filter(|(k, _)| of(k))
            .map(|(k, f)| (*k, self.migrations.get(k).map_or(f.server, |m| m.server)))
            .collect();
        removed.extend(
            self.migrations
                .iter()
                .filter(|(k, _)| of(k) && !self.flows.contains_key(k))
                .map(|(k, m)| (*k, m.server)),
        );
        for (k, _) in &removed {
            self.flows.remove(k);
            self.migrations.remove(k);
        }
        Ok(removed)
    }
    fn drain_events(&mut self, out: &mut Vec<FlowEvent>) -> Result<usize> {
        let n = self.events.len();
        out.extend(self.events.drain(..));
        Ok(n)
    }
    fn scan_flows(
        &mut self,
        cursor: &mut FlowScanCursor,
        budget: usize,
        out: &mut Vec<(CFlowKey, CFlow)>,
    ) -> Result<bool> {
        // Key order, so that a position survives inserts and deletes.
        let mut keys: Vec<CFlowKey> = self.flows.keys().copied().collect();
        keys.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        let start = (cursor.pos.unwrap_or(0) as usize).min(keys.len());
        let end = start.saturating_add(budget.max(1)).min(keys.len());
        out.extend(keys[start..end].iter().map(|k| (*k, self.flows[k])));
        if end >= keys.len() {
            cursor.pos = None;
            return Ok(true);
        }
        cursor.pos = Some(end as u64);
        Ok(false)
    }
}
