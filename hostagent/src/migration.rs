//! The glue between the TCP endpoint and the TCPMig engine on one host.
//!
//! Sans-IO like both of them: [`Migrator`] reacts to engine events by
//! exporting, importing, freezing and forgetting connections, and decides
//! what happens to a TCP segment that arrives for a flow in migration.
//!
//! Invariants:
//! - a connection is in exactly one of: served here (`by_flow`), frozen
//!   (exported, the engine holds its snapshot until the target answers),
//!   gone (migrated out or lost), or unknown;
//! - a segment for a frozen or recently gone flow is dropped silently, never
//!   answered with a RST: the client retransmits and the switch sends the
//!   retransmission to the new owner;
//! - a segment for a flow being migrated in is buffered by the engine until
//!   the import, then replayed into the imported connection.

use capybara_proto::time::{Duration, Instant};
use capybara_proto::FlowKey;
use capybara_tcp::{ConnId, Endpoint};
use capybara_tcpmig::{BufferVerdict, Engine, Event, MigrationId, Reason, Telemetry};
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;

/// How long segments of a migrated-out flow are dropped instead of reset.
const GONE_LINGER: Duration = Duration::from_secs(5);
/// Migrations remembered for the API and tests.
const RECENT: usize = 1024;

/// The outcome of one migration, as reported to operators.
#[derive(Debug, Clone, Copy)]
pub struct MigrationRecord {
    pub id: MigrationId,
    pub flow: FlowKey,
    pub outcome: Outcome,
    pub peer: Ipv4Addr,
    pub telemetry: Option<Telemetry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    MigratedOut,
    MigratedIn,
    Resumed(Reason),
    Lost(Reason),
    AbortedIn,
    ImportFailed,
}

/// What became of a connection handle the application holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleState {
    /// Served here under this (possibly new) id.
    Live(ConnId),
    /// Exported; the outcome is not known yet (calls would block).
    Frozen,
    /// Moved to another server; calls report it.
    Moved(Ipv4Addr),
    /// Lost with a failed target; calls report a reset.
    Lost,
}

pub struct Migrator {
    pub engine: Engine,
    /// Connections served here, by flow (owned: accepted or imported).
    by_flow: HashMap<FlowKey, ConnId>,
    /// Origin: handle of each exported connection and its snapshot, kept to
    /// resume locally if the migration does not happen.
    exported: HashMap<MigrationId, (ConnId, FlowKey, Vec<u8>)>,
    frozen_flows: HashMap<FlowKey, ConnId>,
    gone_flows: HashMap<FlowKey, Instant>,
    handles: HashMap<ConnId, HandleState>,
    /// Resumed connections come back through the endpoint's accept queue;
    /// these ids belong to existing handles, not to new connections.
    resumed: HashMap<ConnId, ConnId>,
    /// Endpoint id of a resumed connection -> the application's handle.
    aliases: HashMap<ConnId, ConnId>,
    recent: VecDeque<MigrationRecord>,
    scratch: Vec<u8>,
    local: Ipv4Addr,
}

impl Migrator {
    pub fn new(engine: Engine, local: Ipv4Addr) -> Migrator {
        Migrator {
            engine,
            by_flow: HashMap::with_capacity(1024),
            exported: HashMap::new(),
            frozen_flows: HashMap::new(),
            gone_flows: HashMap::new(),
            handles: HashMap::new(),
            resumed: HashMap::new(),
            aliases: HashMap::new(),
            recent: VecDeque::with_capacity(RECENT),
            scratch: Vec::with_capacity(64 * 1024),
            local,
        }
    }

    /// A connection accepted by the application (new or migrated in).
    pub fn track(&mut self, flow: FlowKey, id: ConnId) {
        self.by_flow.insert(flow, id);
        self.gone_flows.remove(&flow);
    }

    /// The application released the handle.
    pub fn untrack(&mut self, flow: Option<FlowKey>, id: ConnId) {
        if let Some(f) = flow {
            if self.by_flow.get(&f) == Some(&id) {
                self.by_flow.remove(&f);
            }
        }
        if let Some(HandleState::Live(e)) = self.handles.remove(&id) {
            self.aliases.remove(&e);
        }
    }

    /// Flows served here and not migrating (for policies and test drivers).
    pub fn flows(&self) -> impl Iterator<Item = (&FlowKey, &ConnId)> {
        self.by_flow.iter()
    }

    /// What a handle held by the application refers to now.
    pub fn handle(&self, id: ConnId) -> HandleState {
        self.handles
            .get(&id)
            .copied()
            .unwrap_or(HandleState::Live(id))
    }

    /// If `id` (just accepted from the endpoint) is a resumed connection,
    /// returns the application handle it belongs to.
    pub fn take_resumed(&mut self, id: ConnId) -> Option<ConnId> {
        let app = self.resumed.remove(&id)?;
        self.aliases.insert(id, app);
        Some(app)
    }

    /// The application handle an endpoint id belongs to.
    pub fn app_handle(&self, endpoint_id: ConnId) -> ConnId {
        self.aliases
            .get(&endpoint_id)
            .copied()
            .unwrap_or(endpoint_id)
    }

    pub fn recent(&self) -> impl Iterator<Item = &MigrationRecord> {
        self.recent.iter()
    }

    fn record(&mut self, r: MigrationRecord) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(r);
    }

    /// Decides the fate of a TCP segment before the endpoint sees it.
    /// Returns true when the endpoint should process it.
    pub fn filter_segment(&mut self, now: Instant, flow: FlowKey, segment: &[u8]) -> bool {
        if self.frozen_flows.contains_key(&flow) {
            return false;
        }
        // The engine first: a flow that left recently may be migrating back
        // in, and its segments must be buffered for the import, not dropped
        // as "gone" (that stalled the client until its RTO).
        if !matches!(
            self.engine.buffer_segment(now, flow, segment),
            BufferVerdict::NotMigrating
        ) {
            return false;
        }
        if let Some(until) = self.gone_flows.get(&flow) {
            if *until > now {
                return false;
            }
            self.gone_flows.remove(&flow);
        }
        true
    }

    /// Starts migrating the connection of `flow` to `target` (or a target
    /// the switch picks).
    pub fn migrate(
        &mut self,
        now: Instant,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
    ) -> Result<MigrationId, String> {
        if !self.by_flow.contains_key(&flow) {
            return Err(format!("no connection {flow} served here"));
        }
        self.engine
            .migrate_out(now, flow, target)
            .map_err(|e| e.to_string())
    }

    /// Handles the engine's events. `woken` collects application handles
    /// whose state changed, so that the runtime wakes their tasks.
    pub fn process_events(&mut self, now: Instant, tcp: &mut Endpoint, woken: &mut Vec<ConnId>) {
        while let Some(ev) = self.engine.poll_event() {
            match ev {
                Event::ExportNow { id, flow } => {
                    let Some(&cid) = self.by_flow.get(&flow) else {
                        // The application closed it meanwhile: nothing to move.
                        let _ = self.engine.abort_out(now, id);
                        continue;
                    };
                    let mut snap = Vec::with_capacity(tcp.snapshot_len(now, cid, 0).unwrap_or(256));
                    match tcp.export_to_vec(now, cid, &[], &mut snap) {
                        Ok(_) => {
                            self.by_flow.remove(&flow);
                            self.frozen_flows.insert(flow, cid);
                            self.handles.insert(cid, HandleState::Frozen);
                            let _ = self.engine.provide_snapshot(now, id, snap.clone());
                            self.exported.insert(id, (cid, flow, snap));
                        }
                        Err(_) => {
                            let _ = self.engine.abort_out(now, id);
                        }
                    }
                }
                Event::MigratedOut {
                    id,
                    flow,
                    target,
                    telemetry,
                } => {
                    if let Some((cid, _, _)) = self.exported.remove(&id) {
                        self.frozen_flows.remove(&flow);
                        self.gone_flows.insert(flow, now + GONE_LINGER);
                        self.handles.insert(cid, HandleState::Moved(target));
                        woken.push(cid);
                    }
                    self.record(MigrationRecord {
                        id,
                        flow,
                        outcome: Outcome::MigratedOut,
                        peer: target,
                        telemetry: Some(telemetry),
                    });
                }
                Event::Resumed { id, flow, reason } => {
                    if let Some((cid, _, snap)) = self.exported.remove(&id) {
                        self.frozen_flows.remove(&flow);
                        match tcp.import(now, &snap) {
                            Ok(imp) => {
                                self.resumed.insert(imp.id, cid);
                                self.handles.insert(cid, HandleState::Live(imp.id));
                                self.by_flow.insert(flow, imp.id);
                            }
                            Err(_) => {
                                self.handles.insert(cid, HandleState::Lost);
                            }
                        }
                        woken.push(cid);
                    }
                    self.record(MigrationRecord {
                        id,
                        flow,
                        outcome: Outcome::Resumed(reason),
                        peer: Ipv4Addr::UNSPECIFIED,
                        telemetry: None,
                    });
                }
                Event::Lost { id, flow, reason } => {
                    if let Some((cid, _, _)) = self.exported.remove(&id) {
                        self.frozen_flows.remove(&flow);
                        self.handles.insert(cid, HandleState::Lost);
                        woken.push(cid);
                    }
                    self.record(MigrationRecord {
                        id,
                        flow,
                        outcome: Outcome::Lost(reason),
                        peer: Ipv4Addr::UNSPECIFIED,
                        telemetry: None,
                    });
                }
                Event::ImportNow {
                    id, flow, origin, ..
                } => {
                    self.scratch.clear();
                    if let Some(s) = self.engine.snapshot(id) {
                        self.scratch.extend_from_slice(s);
                    }
                    match tcp.import(now, &self.scratch) {
                        Ok(imp) => {
                            let local = self.local;
                            let _ = self.engine.import_done(now, id, |seg| {
                                tcp.handle_segment(now, flow.client_ip, local, seg)
                            });
                            self.by_flow.insert(flow, imp.id);
                            self.gone_flows.remove(&flow);
                        }
                        Err(_) => {
                            let _ = self.engine.import_failed(now, id);
                            self.record(MigrationRecord {
                                id,
                                flow,
                                outcome: Outcome::ImportFailed,
                                peer: origin,
                                telemetry: None,
                            });
                        }
                    }
                }
                Event::MigratedIn {
                    id,
                    flow,
                    origin,
                    telemetry,
                } => {
                    self.record(MigrationRecord {
                        id,
                        flow,
                        outcome: Outcome::MigratedIn,
                        peer: origin,
                        telemetry: Some(telemetry),
                    });
                }
                Event::AbortedIn { id, flow, .. } => {
                    // The switch may still send us the flow's segments (the
                    // entry stays pending toward us until our ABORT decision
                    // passes it, and some are in flight): drop them
                    // silently like those of a gone flow. A RST here would
                    // kill the client's connection, which the origin serves.
                    if !self.by_flow.contains_key(&flow) {
                        self.gone_flows.insert(flow, now + GONE_LINGER);
                    }
                    self.record(MigrationRecord {
                        id,
                        flow,
                        outcome: Outcome::AbortedIn,
                        peer: Ipv4Addr::UNSPECIFIED,
                        telemetry: None,
                    });
                }
            }
        }
    }
}
