//! Diagnostics for stalled relays (`CAPYBARA_SIDECAR_DEBUG=1` in the
//! hostagent's environment; off by default and then costs nothing).
//!
//! Once a second, every relayed connection (and every connection of the
//! service's port that has no relay yet) that holds client bytes or owes
//! replies and made no progress since the previous check is printed on
//! stdout as one `sidecar-stall ...` line: the application handle and what
//! it resolves to, the TCP queues, the relay's flags, whether a migration
//! waits for its manager and whether a task will be woken by the socket.

use super::{Proto, Shared};
use crate::stack::{Inner, Stack};
use capybara_tcp::ConnId;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::rc::{Rc, Weak};

struct Entry {
    port: u16,
    peer: SocketAddrV4,
    app: ConnId,
    sh: Weak<RefCell<Shared>>,
}

thread_local! {
    static ON: bool = std::env::var_os("CAPYBARA_SIDECAR_DEBUG").is_some();
    static RELAYS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn enabled() -> bool {
    ON.with(|on| *on)
}

/// Registers a relay (when diagnostics are on).
pub(super) fn register(port: u16, peer: SocketAddrV4, app: ConnId, sh: &Rc<RefCell<Shared>>) {
    if !enabled() {
        return;
    }
    RELAYS.with(|r| {
        let mut r = r.borrow_mut();
        r.retain(|e| e.sh.strong_count() > 0);
        r.push(Entry {
            port,
            peer,
            app,
            sh: Rc::downgrade(sh),
        });
    });
}

/// What did not change between two checks means no progress.
type Progress = (u32, u32, usize, usize, bool);

pub(super) async fn watch(stack: Stack, local: SocketAddrV4) {
    let port = local.port();
    let mut last: HashMap<SocketAddrV4, Progress> = HashMap::new();
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        let mut now_seen = HashMap::new();
        let mut lines = Vec::new();
        stack.with(|i| {
            let mut with_relay = std::collections::HashSet::new();
            RELAYS.with(|r| {
                for e in r.borrow().iter().filter(|e| e.port == port) {
                    let Some(sh) = e.sh.upgrade() else { continue };
                    with_relay.insert(e.app);
                    let sh = sh.borrow();
                    let (line, prog, busy) = relay_line(i, e, &sh);
                    if busy && last.get(&e.peer) == Some(&prog) {
                        lines.push(line);
                    }
                    now_seen.insert(e.peer, prog);
                }
            });
            // Connections of this port served here with no relay.
            if let Some(m) = &i.transports.mig {
                for (flow, &cid) in m.flows() {
                    if flow.service_port != port {
                        continue;
                    }
                    let app = m.app_handle(cid);
                    if with_relay.contains(&app) {
                        continue;
                    }
                    let Some(l) = i.transports.tcp.load(cid) else {
                        continue;
                    };
                    let Some(c) = i.transports.tcp.connection(cid) else {
                        continue;
                    };
                    let peer = c.remote;
                    let prog = (c.snd.una.0, c.rcv.nxt.0, l.recv_queue, l.send_queue, false);
                    if l.recv_queue + l.send_queue > 0 && last.get(&peer) == Some(&prog) {
                        let queued = i.accepted.get(&port).is_some_and(|q| q.contains(&cid));
                        lines.push(format!(
                            "sidecar-stall port={port} flow={flow} endpoint={} app={} no relay: \
                             accept_queued={queued} state={:?} recv_queue={} send_queue={} \
                             waiting={} tcp={}",
                            cid.0,
                            app.0,
                            l.state,
                            l.recv_queue,
                            l.send_queue,
                            m.managers.is_waiting(flow),
                            tcp_state(c, i.clock.now()),
                        ));
                    }
                    now_seen.insert(peer, prog);
                }
            }
        });
        last = now_seen;
        for l in lines {
            println!("{l}");
        }
    }
}

fn relay_line(i: &Inner, e: &Entry, sh: &Shared) -> (String, Progress, bool) {
    let resolved = i.resolve(e.app);
    let (load, flow, conn) = match resolved {
        crate::migration::HandleState::Live(id) => (
            i.transports.tcp.load(id),
            i.transports.tcp.flow_key(id),
            i.transports.tcp.connection(id),
        ),
        _ => (None, None, None),
    };
    let outstanding = match &sh.proto {
        Proto::Http(t) => t.outstanding(),
        Proto::Resp(r) => r.outstanding,
        Proto::Raw(_) => 0,
    };
    let (recv_q, send_q, rx, acked, state) = load.map_or((0, 0, 0, 0, None), |l| {
        (
            l.recv_queue,
            l.send_queue,
            l.bytes_received,
            l.bytes_acked,
            Some(l.state),
        )
    });
    let waiting = match (&i.transports.mig, flow) {
        (Some(m), Some(f)) => m.managers.is_waiting(&f),
        _ => false,
    };
    let wakers = i
        .wakers
        .get(&e.app)
        .map_or((false, false), |w| (w.read.is_some(), w.write.is_some()));
    let d = sh.dbg;
    let busy = recv_q > 0
        || send_q > 0
        || outstanding > 0
        || !sh.inbuf.is_empty()
        || !sh.to_app.is_empty()
        || !sh.to_client.is_empty()
        || sh.quiesced;
    let line = format!(
        "sidecar-stall peer={} app={} resolved={resolved:?} state={state:?} recv_queue={recv_q} \
         send_queue={send_q} rx={rx} acked={acked} quiesced={} connecting={} closing={} gone={} \
         pinned={:?} inbuf={} to_app={} to_client={} outstanding={outstanding} requests={} \
         client_eof={} app_eof={} fatal={} waiting={waiting} read_waker={} write_waker={} \
         task_waker={} polls={} tcp={}",
        e.peer,
        e.app.0,
        sh.quiesced,
        sh.connecting,
        sh.closing,
        sh.gone,
        sh.pinned,
        sh.inbuf.len(),
        sh.to_app.len(),
        sh.to_client.len(),
        d.requests,
        d.client_eof,
        d.app_eof,
        d.fatal,
        wakers.0,
        wakers.1,
        sh.waker.is_some(),
        d.polls,
        conn.map_or(String::new(), |c| tcp_state(c, i.clock.now())),
    );
    let _ = (rx, acked);
    let prog = conn.map_or((0, 0, recv_q, send_q, sh.quiesced), |c| {
        (c.snd.una.0, c.rcv.nxt.0, recv_q, send_q, sh.quiesced)
    });
    (line, prog, busy)
}

/// The relay's own flags, mirrored into `Shared` for the dump.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct RelayDbg {
    pub requests: u64,
    pub client_eof: bool,
    pub app_eof: bool,
    pub fatal: bool,
    pub polls: u64,
}

/// The send side of a connection, for a stall line.
fn tcp_state(c: &capybara_tcp::conn::Connection, now: capybara_proto::time::Instant) -> String {
    let _ = now;
    format!(
        "state={:?} tx_len={} snd={:?} cc={:?} timers={:?} loss={:?} retries={:?} fin={:?} pending={:?} now={:?}",
        c.state,
        c.tx.len(),
        c.snd,
        c.cc,
        c.timers,
        c.loss,
        c.retries,
        c.fin,
        c.pending,
        now,
    )
}
