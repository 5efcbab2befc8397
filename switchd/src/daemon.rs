//! The switchd daemon: one control thread owns the [`ControlPlane`] over the
//! XDP data plane and runs, without ever waiting for the store:
//! - the control channel (UDP, MAC'd): REGISTER -> server entry in the data
//!   plane and REGISTER_ACK; HEARTBEAT; SET_OWNER; ERROR; DRAIN / MIGRATE
//!   sent to servers on operator request;
//! - the pool monitor: every `load_interval`, a LOAD-NOTIFICATION to each
//!   live server's data address, liveness checks, target-ring refresh;
//! - flow events to the store's batching writer, closed-flow reaping;
//! - a status snapshot for the HTTP endpoint (`/status`, `/metrics`).
//!
//! Store work (server records, leases, flow scans) runs on a small tokio
//! runtime; the control thread only spawns onto it or reads results that
//! are already there. HA: with `[ha] enabled`, the process first waits as a
//! standby (data plane loaded, not attached, flow table kept warm from the
//! store), then attaches when it wins the lease (see docs/SWITCHD.md).
//!
//! Untrusted input: every datagram is parsed with `parse_verified`; bad MAC,
//! unknown version or kind, malformed bodies, replays and requests from
//! unregistered servers are counted by reason and dropped (answered with
//! ERROR where the sender is authenticated).

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use anyhow::Context;
use capybara_proto::control::{
    self as ctl, ControlBody, ControlError as WireError, ControlKind, ControlRepr, ErrorCode,
    ErrorMsg, RegisterAck,
};
use capybara_proto::load::LoadRepr;
use capybara_proto::{ports, FlowKey, Instant, MigrationKey, ServerId};
use capybara_store::{FlowWriter, FlowWriterConfig, LeaderLease, ServerState, Store};
use serde_json::json;

use crate::abi::*;
use crate::bpf::{BpfDataPlane, BpfOptions};
use crate::config::{Config, Role};
use crate::control::{ControlConfig, ControlPlane, Liveness, PoolSpec};
use crate::dataplane::DataPlane;
use crate::persist::StoreSink;
use crate::sys;

static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SHUTDOWN.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
}

/// Operator requests from the HTTP endpoint to the control thread.
#[derive(Debug)]
pub enum Command {
    Drain {
        server: ServerId,
        deadline_ms: u32,
        cancel: bool,
    },
    Migrate {
        server: ServerId,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
    },
}

/// What the HTTP thread serves; refreshed by the control thread.
#[derive(Default)]
struct Published {
    status: String,
    metrics: String,
}

/// Per-server facts the data plane does not hold.
#[derive(Debug, Clone)]
struct Peer {
    mgmt: SocketAddr,
    last_seq: u64,
    connections: u32,
    migrations_in_flight: u32,
    load_pps: u64,
    rx_backlog_bytes: u64,
    draining_acked: bool,
    /// A DRAIN still to (re)send: (deadline_ms, cancel, retries left).
    pending_drain: Option<(u32, bool, u32)>,
}

fn clock(start: StdInstant) -> Instant {
    Instant::from_micros(start.elapsed().as_micros() as u64)
}

/// Entry point of the daemon.
pub fn run(cfg: Config) -> anyhow::Result<()> {
    install_signal_handlers();
    let key = cfg.load_key()?;
    // Resolve interfaces before anything else: a typo should fail fast.
    let mut ifaces = Vec::new();
    for (i, ifc) in cfg.interfaces.iter().enumerate() {
        let idx = sys::ifindex(&ifc.name)
            .with_context(|| format!("config field `interfaces[{i}].name` = {:?}", ifc.name))?;
        let mac = sys::iface_mac(&ifc.name)
            .with_context(|| format!("config field `interfaces[{i}].name` = {:?}", ifc.name))?;
        ifaces.push((idx, ifc.role, mac));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("switchd-store")
        .build()?;
    let store: Option<Arc<dyn Store>> = match &cfg.store {
        Some(spec) => Some(
            rt.block_on(capybara_store::open(&spec.to_store_config()))
                .with_context(|| format!("opening store {spec:?}"))?,
        ),
        None => None,
    };
    let published = Arc::new(Mutex::new(Published::default()));
    let (cmd_tx, cmd_rx) = mpsc::channel();
    start_http(cfg.metrics_listen, published.clone(), cmd_tx)?;

    let dp = BpfDataPlane::load(BpfOptions {
        max_flows: cfg.max_flows,
        ..Default::default()
    })
    .context("loading the XDP data plane (needs root / CAP_BPF)")?;
    let mut sw = Switch::new(
        cfg,
        key,
        dp,
        ifaces,
        store,
        rt.handle().clone(),
        published,
        cmd_rx,
    )?;
    let result = sw.main();
    sw.shutdown(&rt);
    drop(sw);
    rt.shutdown_timeout(Duration::from_secs(2));
    eprintln!("switchd: stopped");
    result
}

struct Switch {
    cfg: Config,
    key: MigrationKey,
    cp: ControlPlane<BpfDataPlane>,
    ifaces: Vec<(u32, Role, [u8; 6])>,
    store: Option<Arc<dyn Store>>,
    rt: tokio::runtime::Handle,
    sink: Option<StoreSink>,
    published: Arc<Mutex<Published>>,
    cmd_rx: mpsc::Receiver<Command>,
    start: StdInstant,
    epoch: u32,
    seq: u64,
    load_seq: u64,
    peers: BTreeMap<ServerId, Peer>,
    drops: BTreeMap<&'static str, u64>,
    accepted: BTreeMap<&'static str, u64>,
    role: &'static str,
    candidate: String,
    lease: Option<LeaderLease>,
    lease_lost: Arc<AtomicBool>,
    takeover_ms: Option<f64>,
    restored_flows: usize,
    tick_overruns: u64,
    ticks: u64,
    load_sent: u64,
    flow_counts: (usize, usize),
    /// Standby: flows loaded from the store, to apply deltas.
    warm: HashMap<FlowKey, ServerId>,
    warm_syncs: u64,
    /// Took over on the interfaces' evidence, before holding the lease.
    fast_takeover: bool,
    garp_sent: u64,
    campaign_pending: Arc<AtomicBool>,
    won_lease: Arc<Mutex<Option<LeaderLease>>>,
}

impl Switch {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: Config,
        key: MigrationKey,
        dp: BpfDataPlane,
        ifaces: Vec<(u32, Role, [u8; 6])>,
        store: Option<Arc<dyn Store>>,
        rt: tokio::runtime::Handle,
        published: Arc<Mutex<Published>>,
        cmd_rx: mpsc::Receiver<Command>,
    ) -> anyhow::Result<Self> {
        let mut ccfg = ControlConfig::new(cfg.dead_after, cfg.target_policy);
        ccfg.closed_linger = cfg.closed_linger;
        let mut cp = ControlPlane::new(dp, ccfg);
        cp.dp.set_config(CConfig::new(cfg.switch_addr()))?;
        for (idx, role, mac) in &ifaces {
            let r = match role {
                Role::Client => IFACE_CLIENT,
                Role::Server => IFACE_SERVER,
            };
            cp.dp.set_iface(
                *idx,
                CIface {
                    role: r,
                    mac: *mac,
                    pad: 0,
                },
            )?;
            cp.dp.add_tx_port(*idx)?;
        }
        for s in &cfg.services {
            let spec = PoolSpec {
                members: s
                    .pool
                    .iter()
                    .map(|m| (ServerId(m.server), m.weight))
                    .collect(),
                open: s.pool.is_empty(),
            };
            cp.add_service_with_pool(*s.vip.ip(), s.vip.port(), s.placement, spec)?;
        }
        let sink = store.as_ref().map(|st| {
            let _g = rt.enter();
            StoreSink::new(Arc::new(FlowWriter::spawn(
                st.clone(),
                FlowWriterConfig::default(),
            )))
        });
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let epoch = (now_s.as_secs() as u32) ^ (std::process::id() << 16) ^ now_s.subsec_nanos();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let candidate = cfg
            .ha
            .candidate
            .clone()
            .unwrap_or_else(|| format!("{}-{}", host.trim(), std::process::id()));
        Ok(Switch {
            cfg,
            key,
            cp,
            ifaces,
            store,
            rt,
            sink,
            published,
            cmd_rx,
            start: StdInstant::now(),
            epoch,
            seq: 0,
            load_seq: 0,
            peers: BTreeMap::new(),
            drops: BTreeMap::new(),
            accepted: BTreeMap::new(),
            role: "starting",
            candidate,
            lease: None,
            lease_lost: Arc::new(AtomicBool::new(false)),
            takeover_ms: None,
            restored_flows: 0,
            tick_overruns: 0,
            ticks: 0,
            load_sent: 0,
            flow_counts: (0, 0),
            warm: HashMap::new(),
            warm_syncs: 0,
            fast_takeover: false,
            garp_sent: 0,
            campaign_pending: Arc::new(AtomicBool::new(false)),
            won_lease: Arc::new(Mutex::new(None)),
        })
    }

    fn now(&self) -> Instant {
        clock(self.start)
    }

    fn main(&mut self) -> anyhow::Result<()> {
        if self.cfg.ha.enabled {
            self.role = "standby";
            if !self.wait_for_lease()? {
                return Ok(());
            }
        }
        let t0 = StdInstant::now();
        self.sync_from_store()?;
        // Restored servers were loaded while standing by: their liveness
        // clock starts now, and their next heartbeats keep them live.
        let now = self.now();
        let ids: Vec<ServerId> = self
            .cp
            .servers()
            .filter(|s| s.liveness != Liveness::Dead)
            .map(|s| s.id)
            .collect();
        for id in ids {
            let _ = self.cp.heartbeat(now, id);
        }
        self.attach_all()?;
        if self.cfg.ha.claim_vips {
            self.claim_vips();
        }
        self.role = "active";
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.takeover_ms = Some(ms);
        eprintln!(
            "switchd: active (epoch {:#x}); attached to {} interfaces, {} servers and {} flows from the store, in {ms:.1} ms",
            self.epoch,
            self.ifaces.len(),
            self.cp.servers().count(),
            self.restored_flows
        );
        self.serve()
    }

    /// Attaches to every interface. A dead predecessor's links vanish with
    /// its process; one still alive (lost lease, not yet noticed) holds the
    /// interface, so retry for a bounded time.
    fn attach_all(&mut self) -> anyhow::Result<()> {
        let ifs: Vec<u32> = self.ifaces.iter().map(|i| i.0).collect();
        for idx in ifs {
            let mut tries = 0;
            loop {
                match self.cp.dp.attach(idx) {
                    Ok(()) => break,
                    Err(e) if tries < 100 && !SHUTDOWN.load(Ordering::SeqCst) => {
                        if tries == 0 {
                            eprintln!("switchd: attach to ifindex {idx} failed ({e}); retrying");
                        }
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    /// Standby: campaign every 100 ms, keep the flow table warm. Returns
    /// false on shutdown.
    fn wait_for_lease(&mut self) -> anyhow::Result<bool> {
        let store = self.store.clone().context("HA needs a store")?;
        let ttl = Duration::from_millis(self.cfg.ha.lease_ttl_ms);
        let sync_every = Duration::from_millis(self.cfg.ha.flow_sync_interval_ms);
        let mut next_sync = StdInstant::now();
        eprintln!(
            "switchd: standby as {:?} in election {:?}",
            self.candidate, self.cfg.ha.election
        );
        // Same-box standby: once the active's program has been seen on our
        // interfaces, its disappearance from all of them means the active
        // is gone (a process's bpf_links die with it). Attaching is then
        // safe without waiting for the lease to expire: an XDP link is
        // exclusive per interface, so the interfaces themselves fence a
        // live active out. The lease is still taken before serving HA
        // duties that need it (renewal, fencing token).
        let ifs: Vec<u32> = self.ifaces.iter().map(|i| i.0).collect();
        let mut seen_active_program = false;
        let mut next_campaign = StdInstant::now();
        // Bounded by SHUTDOWN or winning; each round sleeps 10 ms.
        loop {
            if SHUTDOWN.load(Ordering::SeqCst) {
                return Ok(false);
            }
            let attached = ifs
                .iter()
                .filter(|i| {
                    self.cp
                        .dp
                        .attached_prog_id(**i)
                        .map(|id| id != 0)
                        .unwrap_or(false)
                })
                .count();
            if attached > 0 {
                seen_active_program = true;
            } else if seen_active_program && self.cfg.ha.fast_takeover {
                eprintln!("switchd: the active's XDP programs are gone from every interface: taking over before the lease expires");
                self.fast_takeover = true;
                return Ok(true);
            }
            if StdInstant::now() < next_campaign {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            next_campaign = StdInstant::now() + Duration::from_millis(100);
            let won = self.rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(2),
                    store.campaign(&self.cfg.ha.election, &self.candidate, ttl),
                )
                .await
            });
            match won {
                Ok(Ok(Some(lease))) => {
                    eprintln!(
                        "switchd: won election {:?} (term {})",
                        lease.info.election, lease.info.term
                    );
                    self.lease = Some(lease);
                    return Ok(true);
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => eprintln!("switchd: campaign: {e}"),
                Err(_) => eprintln!("switchd: campaign timed out"),
            }
            if StdInstant::now() >= next_sync {
                if let Err(e) = self.sync_from_store() {
                    eprintln!("switchd: standby flow sync: {e:#}");
                }
                self.warm_syncs += 1;
                next_sync = StdInstant::now() + sync_every;
                self.publish();
            }
        }
    }

    /// Gratuitous ARP for every VIP on every client-side interface.
    fn claim_vips(&mut self) {
        let mut vips: Vec<Ipv4Addr> = self.cfg.services.iter().map(|s| *s.vip.ip()).collect();
        vips.sort();
        vips.dedup();
        for (idx, role, mac) in &self.ifaces {
            if *role == Role::Client {
                match sys::send_garp(*idx, *mac, &vips) {
                    Ok(n) => self.garp_sent += n as u64,
                    Err(e) => eprintln!("switchd: gratuitous ARP on ifindex {idx}: {e}"),
                }
            }
        }
    }

    /// After a fast takeover: win the lease as soon as it expires (the
    /// dead active cannot renew it). Non-blocking: polled from `serve`.
    fn campaign_in_background(&mut self) {
        let (Some(store), true) = (self.store.clone(), self.lease.is_none()) else {
            return;
        };
        if self.campaign_pending.load(Ordering::SeqCst) {
            return;
        }
        self.campaign_pending.store(true, Ordering::SeqCst);
        let slot = self.won_lease.clone();
        let pending = self.campaign_pending.clone();
        let (election, candidate, ttl) = (
            self.cfg.ha.election.clone(),
            self.candidate.clone(),
            Duration::from_millis(self.cfg.ha.lease_ttl_ms),
        );
        self.rt.spawn(async move {
            if let Ok(Ok(Some(lease))) = tokio::time::timeout(
                Duration::from_secs(2),
                store.campaign(&election, &candidate, ttl),
            )
            .await
            {
                eprintln!(
                    "switchd: won election {:?} (term {}) after the fast takeover",
                    lease.info.election, lease.info.term
                );
                if let Ok(mut s) = slot.lock() {
                    *s = Some(lease);
                }
            }
            pending.store(false, Ordering::SeqCst);
        });
    }

    /// Servers and flows from the store into the (attached or not) data
    /// plane, as a delta against what was loaded before.
    fn sync_from_store(&mut self) -> anyhow::Result<()> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        let (servers, flows) = self
            .rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), async {
                    Ok::<_, capybara_store::StoreError>((
                        store.list_servers().await?,
                        store.scan_flows().await?,
                    ))
                })
                .await
            })
            .context("store did not answer within 5 s")??;
        let now = self.now();
        for s in servers {
            if matches!(s.state, ServerState::Dead | ServerState::Drained) {
                continue;
            }
            if self
                .cp
                .server(s.id)
                .map(|x| x.data_ip == s.data_addr && x.liveness != Liveness::Dead)
                .unwrap_or(false)
            {
                continue;
            }
            let Some(mac) = s
                .name
                .split_whitespace()
                .find_map(|t| t.strip_prefix("data_mac="))
                .and_then(sys::parse_mac)
            else {
                eprintln!("switchd: stored server {} has no data_mac in its record; waiting for its REGISTER", s.id);
                continue;
            };
            let (dev, ifindex) = match sys::route_dev(s.data_addr) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("switchd: stored server {}: {e}", s.id);
                    continue;
                }
            };
            let src_mac = sys::iface_mac(&dev)?;
            self.cp.register_for(
                now,
                s.id,
                s.data_addr,
                mac,
                ifindex,
                src_mac,
                s.weight.max(1),
                &[],
            )?;
            if s.state == ServerState::Draining {
                self.cp.set_draining(s.id, true)?;
            }
            if let SocketAddr::V4(_) = s.mgmt_addr {
                self.peers
                    .entry(s.id)
                    .or_insert_with(|| new_peer(s.mgmt_addr));
            }
        }
        let fresh: HashMap<FlowKey, ServerId> = flows.iter().map(|m| (m.key, m.server)).collect();
        let changed: Vec<(FlowKey, ServerId)> = fresh
            .iter()
            .filter(|(k, s)| self.warm.get(k) != Some(s))
            .map(|(k, s)| (*k, *s))
            .collect();
        let gone: Vec<FlowKey> = self
            .warm
            .keys()
            .filter(|k| !fresh.contains_key(k))
            .copied()
            .collect();
        let (loaded, _skipped) = self.cp.load_flows(&changed)?;
        self.cp.unload_flows(&gone)?;
        self.restored_flows = fresh.len();
        let _ = loaded;
        self.warm = fresh;
        Ok(())
    }

    fn serve(&mut self) -> anyhow::Result<()> {
        let sock = UdpSocket::bind(self.cfg.control_listen).with_context(|| {
            format!(
                "binding the control channel on {} (config field `control_listen`)",
                self.cfg.control_listen
            )
        })?;
        let load_sock = UdpSocket::bind(SocketAddrV4::new(self.cfg.switch_addr(), 0))
            .context("binding the load-notification socket")?;
        load_sock.set_nonblocking(true)?;
        sock.set_nonblocking(true)?;
        self.warm.clear();
        let interval = self.cfg.load_interval;
        let mut next_tick = self.now() + interval;
        let mut next_flush = self.now();
        let mut next_status = self.now();
        let mut next_count = self.now();
        let mut next_renew = self.now();
        let mut buf = vec![0u8; 2048];
        // Bounded by SHUTDOWN; each iteration waits at most one interval.
        while !SHUTDOWN.load(Ordering::SeqCst) {
            if self.lease_lost.load(Ordering::SeqCst) {
                anyhow::bail!("lost the leader lease: stepping down (detaching) so that the new leader owns the interfaces");
            }
            let now = self.now();
            if now >= next_tick {
                self.ticks += 1;
                let reports = self.cp.tick(now)?;
                self.after_tick(now);
                for r in reports {
                    self.load_seq += 1;
                    let repr = LoadRepr {
                        epoch: self.epoch,
                        sequence: self.load_seq,
                        interval_us: interval.as_micros() as u32,
                        server_id: r.server,
                        own_load: r.own_load,
                        pool_load: r.pool_load,
                        live_servers: r.live_servers,
                        least_loaded: r.least_loaded,
                    };
                    let mut b = [0u8; capybara_proto::load::LEN];
                    if repr.emit(&mut b).is_ok()
                        && load_sock
                            .send_to(&b, SocketAddrV4::new(r.data_ip, ports::LOAD))
                            .is_ok()
                    {
                        self.load_sent += 1;
                    }
                }
                next_tick += interval;
                if next_tick < now {
                    self.tick_overruns += 1;
                    next_tick = now + interval;
                }
            }
            if now >= next_flush {
                if let Some(sink) = self.sink.as_mut() {
                    self.cp.flush_events(now, sink)?;
                } else {
                    let mut devnull = crate::control::VecSink::default();
                    self.cp.flush_events(now, &mut devnull)?;
                }
                next_flush = now + Duration::from_millis(2);
            }
            if now >= next_count {
                self.flow_counts = self.cp.dp.table_sizes()?;
                next_count = now + Duration::from_secs(1);
            }
            if now >= next_status {
                self.publish();
                next_status = now + Duration::from_millis(200);
            }
            if self.cfg.ha.enabled && self.lease.is_none() && now >= next_renew {
                let won = self.won_lease.lock().ok().and_then(|mut l| l.take());
                if let Some(l) = won {
                    self.lease = Some(l);
                } else {
                    self.campaign_in_background();
                    next_renew = now + Duration::from_millis(100);
                }
            }
            if self.lease.is_some() && now >= next_renew {
                self.renew_lease();
                next_renew = now + Duration::from_millis(self.cfg.ha.lease_ttl_ms.max(1000) / 4);
            }
            while let Ok(cmd) = self.cmd_rx.try_recv() {
                self.command(&sock, cmd);
            }
            // ppoll, not SO_RCVTIMEO: the latter rounds up to jiffies (4 ms
            // at HZ=250), far coarser than the 1 ms pool-monitor interval.
            let wait = next_tick.saturating_since(self.now());
            wait_readable(&sock, wait);
            // Everything queued, without waiting (bounded per round).
            for _ in 0..256 {
                match sock.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        let now = self.now();
                        if let Some(reply) = self.handle_control(now, from, &buf[..n]) {
                            let _ = sock.send_to(&reply, from);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        eprintln!("switchd: control channel: {e}");
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Liveness side effects: record newly dead servers in the store, and
    /// resend pending DRAINs.
    fn after_tick(&mut self, _now: Instant) {
        let dead: Vec<ServerId> = self
            .cp
            .servers()
            .filter(|s| s.liveness == Liveness::Dead && self.peers.contains_key(&s.id))
            .map(|s| s.id)
            .collect();
        for id in dead {
            self.peers.remove(&id);
            eprintln!(
                "switchd: server {id} missed heartbeats for {:?}: dead, entries removed",
                self.cfg.dead_after
            );
            self.store_state(id, ServerState::Dead);
        }
    }

    fn store_state(&self, id: ServerId, state: ServerState) {
        if let Some(store) = self.store.clone() {
            self.rt.spawn(async move {
                if let Err(e) = store.set_server_state(id, state).await {
                    eprintln!("switchd: store: server {id} -> {state:?}: {e}");
                }
            });
        }
    }

    fn renew_lease(&mut self) {
        let (Some(store), Some(lease)) = (self.store.clone(), self.lease.clone()) else {
            return;
        };
        let lost = self.lease_lost.clone();
        self.rt.spawn(async move {
            match tokio::time::timeout(lease.ttl / 2, store.keep_alive(&lease)).await {
                Ok(Ok(())) => {}
                Ok(Err(capybara_store::StoreError::NotLeader { .. })) => {
                    lost.store(true, Ordering::SeqCst)
                }
                Ok(Err(e)) => eprintln!("switchd: lease keep-alive: {e}"),
                Err(_) => eprintln!("switchd: lease keep-alive timed out"),
            }
        });
    }

    fn drop_msg(&mut self, reason: &'static str) -> Option<Vec<u8>> {
        *self.drops.entry(reason).or_default() += 1;
        None
    }

    fn reply(&mut self, id: ServerId, body: ControlBody<'_>) -> Option<Vec<u8>> {
        self.seq += 1;
        let repr = ControlRepr {
            server_id: id,
            seq: self.seq,
            body,
        };
        let mut out = vec![0u8; repr.buffer_len()];
        repr.emit_with_mac(&mut out, &self.key).ok()?;
        Some(out)
    }

    fn error_reply(
        &mut self,
        id: ServerId,
        code: ErrorCode,
        kind: ControlKind,
        seq: u64,
        text: &str,
    ) -> Option<Vec<u8>> {
        let text = &text[..text.len().min(ctl::MAX_ERROR_TEXT)];
        self.reply(
            id,
            ControlBody::Error(ErrorMsg {
                code,
                ref_kind: kind.to_u8(),
                ref_seq: seq,
                text,
            }),
        )
    }

    /// One control datagram. Returns the reply, if any.
    fn handle_control(&mut self, now: Instant, from: SocketAddr, bytes: &[u8]) -> Option<Vec<u8>> {
        let repr = match ControlRepr::parse_verified(bytes, &self.key) {
            Ok(r) => r,
            Err(e) => {
                return self.drop_msg(match e {
                    WireError::BadMac => "bad_mac",
                    WireError::UnsupportedVersion { .. } => "unknown_version",
                    WireError::BadMagic { .. } => "bad_magic",
                    WireError::UnknownKind { .. } => "unknown_kind",
                    WireError::Truncated { .. } | WireError::LengthMismatch { .. } => "truncated",
                    _ => "malformed",
                })
            }
        };
        let id = repr.server_id;
        let kind = repr.body.kind();
        // Replays: every sender's seq strictly increases, except that a
        // REGISTER starts a new sequence (a restarted server).
        if kind != ControlKind::Register {
            match self.peers.get(&id) {
                Some(p) if repr.seq <= p.last_seq => return self.drop_msg("replay"),
                Some(_) => {}
                None => {
                    *self.drops.entry("not_registered").or_default() += 1;
                    if matches!(kind, ControlKind::Heartbeat | ControlKind::SetOwner) {
                        return self.error_reply(
                            id,
                            ErrorCode::NotRegistered,
                            kind,
                            repr.seq,
                            "register first",
                        );
                    }
                    return None;
                }
            }
        }
        *self.accepted.entry(kind_name(kind)).or_default() += 1;
        match repr.body {
            ControlBody::Register(r) => {
                if id.0 == 0 {
                    return self.error_reply(
                        id,
                        ErrorCode::BadRequest,
                        kind,
                        repr.seq,
                        "server id 0 is reserved",
                    );
                }
                let (dev, ifindex) = match sys::route_dev(r.data_addr) {
                    Ok(x) => x,
                    Err(e) => {
                        return self.error_reply(
                            id,
                            ErrorCode::BadRequest,
                            kind,
                            repr.seq,
                            &format!("data address: {e}"),
                        )
                    }
                };
                if !self
                    .ifaces
                    .iter()
                    .any(|(i, role, _)| *i == ifindex && *role == Role::Server)
                {
                    let t = format!(
                        "data address {} is routed via {dev}, not a server-side interface",
                        r.data_addr
                    );
                    return self.error_reply(id, ErrorCode::BadRequest, kind, repr.seq, &t);
                }
                let src_mac = self
                    .ifaces
                    .iter()
                    .find(|(i, _, _)| *i == ifindex)
                    .map(|x| x.2)
                    .unwrap_or_default();
                let wanted: Vec<SocketAddrV4> = r.services.iter().collect();
                if let Err(e) = self.cp.register_for(
                    now,
                    id,
                    r.data_addr,
                    r.data_mac,
                    ifindex,
                    src_mac,
                    u32::from(r.weight).max(1),
                    &wanted,
                ) {
                    let code = if matches!(e, crate::control::ControlError::AddressInUse { .. }) {
                        ErrorCode::IdConflict
                    } else {
                        ErrorCode::Internal
                    };
                    return self.error_reply(id, code, kind, repr.seq, &e.to_string());
                }
                let mut peer = new_peer(from);
                peer.last_seq = repr.seq;
                self.peers.insert(id, peer);
                eprintln!(
                    "switchd: registered {id}: data {} mac {} via {dev}, weight {}",
                    r.data_addr,
                    sys::format_mac(&r.data_mac),
                    r.weight
                );
                if let Some(store) = self.store.clone() {
                    let mut rec = capybara_store::Server::new(
                        id,
                        format!("s{} data_mac={}", id.0, sys::format_mac(&r.data_mac)),
                        from,
                        r.data_addr,
                    );
                    rec.weight = u32::from(r.weight).max(1);
                    self.rt.spawn(async move {
                        if let Err(e) = store.put_server(&rec).await {
                            eprintln!("switchd: store: put server {}: {e}", rec.id);
                        }
                    });
                }
                let ack = RegisterAck {
                    switch_epoch: self.epoch,
                    load_interval_us: self.cfg.load_interval.as_micros() as u32,
                    heartbeat_interval_ms: self.cfg.heartbeat_interval.as_millis() as u32,
                    dead_after_ms: self.cfg.dead_after.as_millis() as u32,
                };
                self.reply(id, ControlBody::RegisterAck(ack))
            }
            ControlBody::Heartbeat(h) => {
                if self.cp.heartbeat(now, id).is_err() {
                    return self.error_reply(
                        id,
                        ErrorCode::NotRegistered,
                        kind,
                        repr.seq,
                        "register first",
                    );
                }
                let mut resend = None;
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                    p.mgmt = from;
                    p.connections = h.connections;
                    p.migrations_in_flight = h.migrations_in_flight;
                    p.load_pps = h.load_pps;
                    p.rx_backlog_bytes = h.rx_backlog_bytes;
                    p.draining_acked = h.flags & ctl::HEARTBEAT_DRAINING != 0;
                    if let Some((deadline, cancel, left)) = p.pending_drain {
                        if p.draining_acked != cancel || left == 0 {
                            p.pending_drain = None;
                        } else {
                            p.pending_drain = Some((deadline, cancel, left - 1));
                            resend = Some((deadline, cancel));
                        }
                    }
                }
                if let Some((deadline_ms, cancel)) = resend {
                    let flags = if cancel { ctl::DRAIN_CANCEL } else { 0 };
                    return self.reply(id, ControlBody::Drain(ctl::Drain { deadline_ms, flags }));
                }
                None
            }
            ControlBody::SetOwner(s) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                let owner = match self.cp.server_by_addr(s.owner) {
                    Some(o) => o.id,
                    None => {
                        return self.error_reply(
                            id,
                            ErrorCode::BadRequest,
                            kind,
                            repr.seq,
                            "owner is not a registered data address",
                        )
                    }
                };
                match self.cp.set_owner(id, s.flow, owner) {
                    Ok(()) => None,
                    Err(e) => {
                        *self.drops.entry("set_owner_refused").or_default() += 1;
                        self.error_reply(id, ErrorCode::UnknownFlow, kind, repr.seq, &e.to_string())
                    }
                }
            }
            ControlBody::Error(e) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                eprintln!(
                    "switchd: {id} reports error {:?} for kind {} seq {}: {}",
                    e.code, e.ref_kind, e.ref_seq, e.text
                );
                None
            }
            // Switch -> server kinds arriving at the switch.
            ControlBody::RegisterAck(_) | ControlBody::Drain(_) | ControlBody::Migrate(_) => {
                self.drop_msg("unexpected_kind")
            }
        }
    }

    fn command(&mut self, sock: &UdpSocket, cmd: Command) {
        match cmd {
            Command::Drain {
                server,
                deadline_ms,
                cancel,
            } => {
                if let Err(e) = self.cp.set_draining(server, !cancel) {
                    eprintln!("switchd: drain {server}: {e}");
                    return;
                }
                self.store_state(
                    server,
                    if cancel {
                        ServerState::Active
                    } else {
                        ServerState::Draining
                    },
                );
                let Some(mgmt) = self.peers.get(&server).map(|p| p.mgmt) else {
                    return;
                };
                let flags = if cancel { ctl::DRAIN_CANCEL } else { 0 };
                if let Some(msg) = self.reply(
                    server,
                    ControlBody::Drain(ctl::Drain { deadline_ms, flags }),
                ) {
                    let _ = sock.send_to(&msg, mgmt);
                }
                if let Some(p) = self.peers.get_mut(&server) {
                    // Resent with heartbeats until the server's flag agrees.
                    p.pending_drain = Some((deadline_ms, cancel, 10));
                }
            }
            Command::Migrate {
                server,
                flow,
                target,
            } => {
                let Some(mgmt) = self.peers.get(&server).map(|p| p.mgmt) else {
                    return;
                };
                if let Some(msg) =
                    self.reply(server, ControlBody::Migrate(ctl::Migrate { flow, target }))
                {
                    let _ = sock.send_to(&msg, mgmt);
                }
            }
        }
    }

    fn publish(&mut self) {
        let stats = self.cp.dp.stats().unwrap_or_default();
        let servers: Vec<serde_json::Value> = self
            .cp
            .servers()
            .map(|s| {
                let p = self.peers.get(&s.id);
                json!({
                    "id": s.id.0, "index": s.index, "data_addr": s.data_ip.to_string(),
                    "mac": sys::format_mac(&s.mac), "weight": s.weight,
                    "state": format!("{:?}", s.liveness).to_lowercase(), "load": s.load,
                    "mgmt_addr": p.map(|p| p.mgmt.to_string()),
                    "connections": p.map(|p| p.connections), "load_pps": p.map(|p| p.load_pps),
                    "migrations_in_flight": p.map(|p| p.migrations_in_flight),
                    "rx_backlog_bytes": p.map(|p| p.rx_backlog_bytes),
                    "draining_acked": p.map(|p| p.draining_acked),
                })
            })
            .collect();
        let services: Vec<serde_json::Value> = self
            .cp
            .services()
            .iter()
            .map(|s| json!({"vip": format!("{}:{}", s.vip, s.port), "index": s.index, "placement": format!("{:?}", s.placement).to_lowercase(),
                 "pool": s.pool.iter().map(|(id, w)| json!({"server": id.0, "weight": w})).collect::<Vec<_>>()}))
            .collect();
        let dp_counters: serde_json::Map<String, serde_json::Value> = STAT_NAMES
            .iter()
            .zip(stats.iter().chain(std::iter::repeat(&0)))
            .map(|(n, v)| (n.to_string(), json!(v)))
            .collect();
        let writer = self.sink.as_ref().map(|s| s.writer().metrics());
        let sinkm = self
            .sink
            .as_ref()
            .map(|s| s.metrics.clone())
            .unwrap_or_default();
        let status = json!({
            "role": self.role,
            "candidate": self.candidate,
            "epoch": self.epoch,
            "lease_term": self.lease.as_ref().map(|l| l.info.term),
            "takeover_ms": self.takeover_ms,
            "fast_takeover": self.fast_takeover,
            "garp_sent": self.garp_sent,
            "attached_ifindexes": self.cp.dp.attached(),
            "servers": servers,
            "services": services,
            "flows": self.flow_counts.0,
            "migrations": self.flow_counts.1,
            "closing_lingering": self.cp.closing_len(),
            "reaped_total": self.cp.reaped_total,
            "restored_flows": self.restored_flows,
            "warm_flows": self.warm.len(),
            "warm_syncs": self.warm_syncs,
            "dataplane": dp_counters,
            "control_drops": self.drops,
            "control_accepted": self.accepted,
            "ticks": self.ticks,
            "tick_overruns": self.tick_overruns,
            "load_notifications_sent": self.load_sent,
            "store": writer.as_ref().map(|m| json!({
                "backlog": m.backlog, "written_total": m.written_total, "batches_total": m.batches_total,
                "batch_size_buckets": m.batch_size_buckets, "overflow_total": m.overflow_total,
                "lag_ms": m.lag.as_secs_f64() * 1e3, "last_batch_lag_ms": m.last_batch_lag.as_secs_f64() * 1e3,
                "flush_errors_total": m.flush_errors_total, "last_error": m.last_error,
                "sink_puts": sinkm.puts, "sink_deletes": sinkm.deletes, "sink_overflow": sinkm.overflow,
                "sink_batches": sinkm.batches, "sink_max_batch": sinkm.max_batch,
            })),
        });
        let mut m = String::new();
        let p = "capybara_switchd";
        m += &format!("{p}_role{{role=\"{}\"}} 1\n", self.role);
        for s in self.cp.servers() {
            m += &format!(
                "{p}_server_load{{server=\"{}\",state=\"{}\"}} {}\n",
                s.id.0,
                format!("{:?}", s.liveness).to_lowercase(),
                s.load
            );
        }
        m += &format!(
            "{p}_flows {}\n{p}_migrations {}\n",
            self.flow_counts.0, self.flow_counts.1
        );
        for (n, v) in STAT_NAMES.iter().zip(stats.iter()) {
            m += &format!("{p}_dataplane_packets_total{{reason=\"{n}\"}} {v}\n");
        }
        for (n, v) in &self.drops {
            m += &format!("{p}_control_drops_total{{reason=\"{n}\"}} {v}\n");
        }
        m += &format!(
            "{p}_tick_overruns_total {}\n{p}_load_notifications_total {}\n",
            self.tick_overruns, self.load_sent
        );
        m += &format!("{p}_reaped_total {}\n", self.cp.reaped_total);
        if let Some(w) = &writer {
            m += &w.to_prometheus();
        }
        if let Ok(mut pb) = self.published.lock() {
            pb.status = serde_json::to_string_pretty(&status).unwrap_or_default();
            pb.metrics = m;
        }
    }

    fn shutdown(&mut self, rt: &tokio::runtime::Runtime) {
        self.cp.dp.detach_all();
        if let Some(sink) = self.sink.take() {
            let w = sink.writer().clone();
            if let Err(e) = rt.block_on(w.close(Duration::from_secs(2))) {
                eprintln!("switchd: {e}");
            }
        }
        if let (Some(store), Some(lease)) = (self.store.clone(), self.lease.take()) {
            let _ = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(1), store.resign(&lease)).await
            });
        }
    }
}

/// Waits until `sock` is readable or `timeout` passed (nanosecond timer).
fn wait_readable(sock: &UdpSocket, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd, valid timespec, no signal mask.
    unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
}

fn new_peer(mgmt: SocketAddr) -> Peer {
    Peer {
        mgmt,
        last_seq: 0,
        connections: 0,
        migrations_in_flight: 0,
        load_pps: 0,
        rx_backlog_bytes: 0,
        draining_acked: false,
        pending_drain: None,
    }
}

fn kind_name(k: ControlKind) -> &'static str {
    match k {
        ControlKind::Register => "register",
        ControlKind::RegisterAck => "register_ack",
        ControlKind::Heartbeat => "heartbeat",
        ControlKind::Drain => "drain",
        ControlKind::Migrate => "migrate",
        ControlKind::Error => "error",
        ControlKind::SetOwner => "set_owner",
    }
}

// ---------------------------------------------------------------------------
// HTTP: GET /status (JSON), GET /metrics (Prometheus text),
// POST /servers/<id>/drain?deadline_ms=N, POST /servers/<id>/undrain,
// POST /migrate?server=ID&client=IP:PORT&service=VIP:PORT[&target=IP].
// Loopback or management side only; one request per connection.
// ---------------------------------------------------------------------------

fn start_http(
    addr: SocketAddr,
    published: Arc<Mutex<Published>>,
    cmds: mpsc::Sender<Command>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).with_context(|| {
        format!("binding the status endpoint (config field `metrics_listen` = {addr})")
    })?;
    static REQUESTS: AtomicU64 = AtomicU64::new(0);
    std::thread::Builder::new().name("switchd-http".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            REQUESTS.fetch_add(1, Ordering::Relaxed);
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 4096];
            let mut n = 0;
            // Bounded: at most 4 KiB of request head.
            while n < buf.len() {
                match c.read(&mut buf[n..]) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        n += k;
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let mut parts = head.split_whitespace();
            let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (code, ctype, body) = route(method, target, &published, &cmds);
            let _ = write!(c, "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    })?;
    Ok(())
}

fn route(
    method: &str,
    target: &str,
    published: &Mutex<Published>,
    cmds: &mpsc::Sender<Command>,
) -> (&'static str, &'static str, String) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let get = |f: fn(&Published) -> String| published.lock().map(|p| f(&p)).unwrap_or_default();
    match (method, path) {
        ("GET", "/status") => ("200 OK", "application/json", get(|p| p.status.clone())),
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4",
            get(|p| p.metrics.clone()),
        ),
        ("POST", "/migrate") => {
            // /migrate?server=ID&client=IP:PORT&service=VIP:PORT[&target=IP]
            let arg = |k: &str| {
                query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            };
            let server = arg("server").and_then(|v| v.parse::<u32>().ok());
            let client = arg("client").and_then(|v| v.parse::<SocketAddrV4>().ok());
            let service = arg("service").and_then(|v| v.parse::<SocketAddrV4>().ok());
            let target = match arg("target").map(|v| v.parse::<Ipv4Addr>()) {
                None => None,
                Some(Ok(t)) => Some(t),
                Some(Err(_)) => {
                    return (
                        "400 Bad Request",
                        "text/plain",
                        "bad target (an IPv4 data address)\n".into(),
                    )
                }
            };
            let (Some(server), Some(client), Some(service)) = (server, client, service) else {
                return (
                    "400 Bad Request",
                    "text/plain",
                    "need server=ID&client=IP:PORT&service=VIP:PORT[&target=IP]\n".into(),
                );
            };
            let flow = FlowKey {
                client_ip: *client.ip(),
                client_port: client.port(),
                service_ip: *service.ip(),
                service_port: service.port(),
            };
            let _ = cmds.send(Command::Migrate {
                server: ServerId(server),
                flow,
                target,
            });
            ("202 Accepted", "text/plain", "accepted\n".into())
        }
        ("POST", p) if p.starts_with("/servers/") => {
            let rest = &p["/servers/".len()..];
            let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
            let Ok(id) = id.parse::<u32>() else {
                return (
                    "400 Bad Request",
                    "text/plain",
                    format!("bad server id {id:?}\n"),
                );
            };
            let deadline_ms = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("deadline_ms="))
                .map(|v| v.parse::<u32>())
                .unwrap_or(Ok(30_000));
            let Ok(deadline_ms) = deadline_ms else {
                return ("400 Bad Request", "text/plain", "bad deadline_ms\n".into());
            };
            let cmd = match action {
                "drain" => Command::Drain {
                    server: ServerId(id),
                    deadline_ms,
                    cancel: false,
                },
                "undrain" => Command::Drain {
                    server: ServerId(id),
                    deadline_ms,
                    cancel: true,
                },
                _ => {
                    return (
                        "404 Not Found",
                        "text/plain",
                        format!("unknown action {action:?}\n"),
                    )
                }
            };
            let _ = cmds.send(cmd);
            ("202 Accepted", "text/plain", "accepted\n".into())
        }
        _ => (
            "404 Not Found",
            "text/plain",
            "GET /status, GET /metrics, POST /servers/<id>/drain|undrain, POST /migrate\n".into(),
        ),
    }
}

/// `switchd --dump`: fetches `/status` (or another path) from a running switchd.
pub fn fetch(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to switchd at {addr}"))?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: switchd\r\nConnection: close\r\n\r\n"
    )?;
    let mut s = String::new();
    c.read_to_string(&mut s)?;
    let body = s
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_routes_parse_requests_and_refuse_bad_ones() {
        let published = Mutex::new(Published {
            status: "{}".into(),
            metrics: "m 1\n".into(),
        });
        let (tx, rx) = mpsc::channel();
        assert_eq!(route("GET", "/status", &published, &tx).0, "200 OK");
        assert_eq!(route("GET", "/metrics", &published, &tx).2, "m 1\n");
        assert_eq!(route("GET", "/nope", &published, &tx).0, "404 Not Found");
        assert_eq!(
            route("POST", "/servers/x/drain", &published, &tx).0,
            "400 Bad Request"
        );
        assert_eq!(
            route("POST", "/servers/3/drain?deadline_ms=abc", &published, &tx).0,
            "400 Bad Request"
        );
        assert_eq!(
            route("POST", "/servers/3/drain?deadline_ms=500", &published, &tx).0,
            "202 Accepted"
        );
        assert!(matches!(
            rx.try_recv(),
            Ok(Command::Drain {
                server: ServerId(3),
                deadline_ms: 500,
                cancel: false
            })
        ));
        assert_eq!(
            route(
                "POST",
                "/migrate?server=1&client=198.18.0.11:4000",
                &published,
                &tx
            )
            .0,
            "400 Bad Request"
        );
        let r = route(
            "POST",
            "/migrate?server=1&client=198.18.0.11:4000&service=198.18.100.1:80&target=198.18.2.12",
            &published,
            &tx,
        );
        assert_eq!(r.0, "202 Accepted");
        match rx.try_recv() {
            Ok(Command::Migrate {
                server,
                flow,
                target,
            }) => {
                assert_eq!(
                    (server, flow.client_port, target),
                    (ServerId(1), 4000, Some(Ipv4Addr::new(198, 18, 2, 12)))
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
