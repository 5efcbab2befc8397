//! The sidecar proxy: unmodified applications behind a migratable stack.
//!
//! Each client connection terminates in the user-space stack (and, with a
//! certificate, in a TLS session of `capybara-tls`); the sidecar relays it
//! to the local application over a kernel loopback connection, one loopback
//! connection per client connection. A per-protocol connection manager
//! (`http1`, `resp`, `raw`) knows where requests and responses end, so a
//! connection can migrate without the application noticing:
//!
//! - to migrate, the manager stops handing requests to the application
//!   (quiesce) and waits until every forwarded request has been answered
//!   and the answer handed to the stack's send queue; then it exports;
//! - requests not forwarded yet travel as they are: unread ones in the TCP
//!   receive queue, read ones (complete or partial) in the manager's state;
//!   a response already queued travels in the TCP send queue and the target
//!   retransmits it if needed. So pipelined requests are answered exactly
//!   once and in order;
//! - the target opens its own loopback connection to its local application
//!   when the connection is imported, and continues;
//! - `raw` has no request boundaries: it migrates only when the relay holds
//!   no byte and nothing moved either way for [`RAW_IDLE`] after the
//!   application's last output (longer, up to [`RAW_PIECES_MAX`], once the
//!   application was seen to pause between pieces of an answer), or for
//!   [`RAW_UNANSWERED`] after bytes the application has not answered yet;
//! - TLS: the session's record-layer state (keys, sequence numbers, a
//!   partially received record, undelivered plaintext) travels in the
//!   manager's state, so the connection moves at any byte of the encrypted
//!   stream with no new handshake.
//!
//! The relay never holds application bytes across a migration: it reads
//! from the application only what the send queue can take right now.
//! Failures of the application (refused, died mid-request) and client
//! errors (malformed or oversized requests) produce a protocol error
//! response or a clean close, never a hang. docs/SIDECAR.md has the whole
//! picture.

mod debug;
pub mod http1;
pub mod raw;
pub mod resp;
pub mod state;

use crate::config::SidecarProtocol;
use crate::socket::{
    moved_to, ConnectionManager, Readiness, StateImporter, TcpListener, TcpStream,
};
use capybara_proto::FlowKey;
use capybara_tls::{TlsConfig, TlsServer};
use state::ConnState;
use std::any::Any;
use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::net::SocketAddrV4;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A raw relay is migratable after this long without a byte either way,
/// when the application's output came last.
pub const RAW_IDLE: Duration = Duration::from_millis(20);
/// ... and after this long when bytes went to the application after its
/// last output (an answer is owed; a loaded machine delays it well past
/// `RAW_IDLE`, issue #8). An application that never answers (one-way
/// traffic) still migrates once quiet this long.
pub const RAW_UNANSWERED: Duration = Duration::from_secs(1);
/// ... and, once the application was seen to pause between two pieces of
/// an answer, twice the longest such pause after its last output, at most
/// this long (`raw::RawConn`): a relay that waited longer between pieces
/// would let unsolicited output more frequent than that block migration.
pub const RAW_PIECES_MAX: Duration = Duration::from_millis(250);
/// How long the sidecar waits for the application to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// After the sidecar closes its side, how long it waits for the client's.
const CLOSE_LINGER: Duration = Duration::from_secs(5);
const RELAY_CHUNK: usize = 64 * 1024;
/// Relay buffers kept for the next connections (`RelayBuffers`).
const RELAY_POOL: usize = 16;
/// Largest plaintext per TLS record write (one record).
const TLS_CHUNK: usize = 16 * 1024;

/// One sidecar service (a `[[service]]` with `app = "sidecar"`).
pub struct Service {
    pub listen: SocketAddrV4,
    pub backend: SocketAddrV4,
    pub protocol: SidecarProtocol,
    pub max_request: usize,
    /// With a certificate: the TLS configuration new connections use
    /// (replaced by [`reload_tls`]).
    pub tls: Option<ServiceTls>,
    /// Seals the TLS session state (keys, sequence numbers) that travels in
    /// a migration, with a key derived from the deployment secret: without
    /// it a TLS connection does not migrate (docs/TLS.md, sealed snapshots).
    pub seal: Option<std::sync::Arc<capybara_tls::SealKey>>,
    /// The application's health check (`crate::health`): a relay that
    /// cannot connect reports it at once.
    pub health: Option<Rc<crate::health::Check>>,
    relay_buffers: RelayBuffers,
}

/// A TLS service's certificate and key: the files the configuration names
/// and the configuration new handshakes use. A reload ([`reload_tls`], on
/// SIGHUP) reads the files again and replaces the configuration only if
/// they load; sessions made earlier (handshaking, established, migrated
/// in) each hold their own and go on untouched. The sidecar runs on one
/// thread: taking the configuration is a `RefCell` borrow per new
/// connection, no lock.
pub struct ServiceTls {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    current: RefCell<TlsConfig>,
}

impl ServiceTls {
    pub fn new(
        cert: impl Into<std::path::PathBuf>,
        key: impl Into<std::path::PathBuf>,
        config: TlsConfig,
    ) -> ServiceTls {
        ServiceTls {
            cert: cert.into(),
            key: key.into(),
            current: RefCell::new(config),
        }
    }

    /// The configuration new handshakes use now.
    pub fn current(&self) -> TlsConfig {
        self.current.borrow().clone()
    }

    /// Reads the files again; on success new handshakes use them and the
    /// new certificate is returned, else the old one stays and the error
    /// names the field, the file and why (as `hostagent --check` does).
    pub fn reload(&self) -> Result<capybara_tls::CertInfo, String> {
        let next = self
            .current
            .borrow()
            .reload_pem_files(&self.cert, &self.key)
            .map_err(|e| tls_error(&self.cert, &self.key, e))?;
        let info = next.certificate();
        *self.current.borrow_mut() = next;
        Ok(info)
    }
}

/// Certificate reloads since start (SIGHUP), all services together:
/// `capybara_tls_reloads_total` in the metrics.
pub static TLS_RELOADS_OK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
pub static TLS_RELOADS_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Reloads every TLS service's certificate and key (the hostagent does on
/// SIGHUP), logging one line per service: the new certificate, or why the
/// old one stays in service. Never fails: a bad file leaves that service
/// as it was. Returns (reloaded, failed).
pub fn reload_tls(services: &[Rc<Service>]) -> (usize, usize) {
    use std::sync::atomic::Ordering::Relaxed;
    let (mut ok, mut failed) = (0, 0);
    for svc in services {
        let Some(t) = &svc.tls else { continue };
        match t.reload() {
            Ok(info) => {
                ok += 1;
                TLS_RELOADS_OK.fetch_add(1, Relaxed);
                eprintln!(
                    "hostagent: service {}: TLS certificate reloaded from {} and {}: {info}",
                    svc.listen,
                    t.cert.display(),
                    t.key.display()
                );
            }
            Err(e) => {
                failed += 1;
                TLS_RELOADS_FAILED.fetch_add(1, Relaxed);
                eprintln!(
                    "hostagent: service {}: TLS reload failed, the previous certificate stays in service: {e}",
                    svc.listen
                );
            }
        }
    }
    if ok + failed == 0 {
        eprintln!("hostagent: TLS reload: no sidecar service has a certificate, nothing to reload");
    }
    (ok, failed)
}

/// The reload counters in Prometheus text.
pub fn render_metrics(labels: &str, out: &mut String) {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let _ = writeln!(
        out,
        "# TYPE capybara_tls_reloads_total counter\n\
         capybara_tls_reloads_total{{{labels},outcome=\"ok\"}} {}\n\
         capybara_tls_reloads_total{{{labels},outcome=\"failed\"}} {}",
        TLS_RELOADS_OK.load(Relaxed),
        TLS_RELOADS_FAILED.load(Relaxed)
    );
}

/// The relays' 64 KiB buffers, recycled: a connection takes one from the
/// pool (or allocates) and gives it back when its relay ends. The pool is
/// filled at start with pages touched, so a standby's first connections
/// (a drain migrating them in) neither allocate nor page-fault: a fresh
/// zeroed buffer was 16 page faults and a 64 KiB memset per connection,
/// ~60% of the backup hostagent's page faults during the drain of `make
/// bench-maintenance` once the TCP queues were pre-warmed (issue #8).
/// A recycled buffer holds a former connection's bytes; the relay only
/// ever reads what it has just written into it.
struct RelayBuffers(RefCell<Vec<Box<[u8]>>>);

impl RelayBuffers {
    fn prewarmed(n: usize) -> RelayBuffers {
        let pool = (0..n)
            .map(|_| {
                let mut b = vec![0u8; RELAY_CHUNK].into_boxed_slice();
                capybara_tcp::buffer::touch_pages(&mut b);
                b
            })
            .collect();
        RelayBuffers(RefCell::new(pool))
    }

    fn take(&self) -> Box<[u8]> {
        self.0
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| vec![0; RELAY_CHUNK].into_boxed_slice())
    }

    fn give(&self, b: Box<[u8]>) {
        let mut pool = self.0.borrow_mut();
        if b.len() == RELAY_CHUNK && pool.len() < RELAY_POOL {
            pool.push(b);
        }
    }
}

impl Service {
    /// A connect to the application for client `peer` failed: logged, and
    /// passive evidence for its health check.
    fn app_connect_failed(&self, peer: SocketAddrV4, e: &dyn std::fmt::Display) {
        println!("sidecar peer={peer} backend={} error={e}", self.backend);
        if let Some(h) = &self.health {
            h.report_connect_failure();
        }
    }

    pub fn from_config(s: &crate::config::ServiceConfig) -> Result<Service, String> {
        s.check_sidecar()
            .map_err(|(f, v, why)| format!("{f} = {v}: {why}"))?;
        let tls = match (load_tls(s)?, &s.tls_cert, &s.tls_key) {
            (Some(c), Some(cert), Some(key)) => Some(ServiceTls::new(cert, key, c)),
            _ => None,
        };
        Ok(Service {
            listen: s.listen,
            backend: s.backend.ok_or("sidecar needs a backend")?,
            protocol: s.protocol.ok_or("sidecar needs a protocol")?,
            max_request: s
                .max_request_bytes
                .unwrap_or(crate::config::DEFAULT_MAX_REQUEST_BYTES),
            tls,
            seal: None,
            health: None,
            relay_buffers: RelayBuffers::prewarmed(RELAY_POOL),
        })
    }
}

/// Loads a sidecar service's certificate chain and key (`tls_cert`,
/// `tls_key`): `None` without TLS. Used at start and by `hostagent --check`.
/// The error names the field and its value (both fields when the key does
/// not match the certificate), then why: `tls_key = "key.pem": cannot read
/// private key file key.pem: No such file or directory (os error 2)`.
pub fn load_tls(s: &crate::config::ServiceConfig) -> Result<Option<TlsConfig>, String> {
    let (Some(cert), Some(key)) = (&s.tls_cert, &s.tls_key) else {
        return Ok(None);
    };
    TlsConfig::from_pem_files(cert, key)
        .map(Some)
        .map_err(|e| tls_error(std::path::Path::new(cert), std::path::Path::new(key), e))
}

/// `e`, preceded by the field (or fields) it is about and its value.
fn tls_error(
    cert: &std::path::Path,
    key: &std::path::Path,
    e: capybara_tls::ConfigError,
) -> String {
    use capybara_tls::ConfigError as E;
    let cert_field = format!("tls_cert = {:?}", cert.display().to_string());
    let key_field = format!("tls_key = {:?}", key.display().to_string());
    let field = match &e {
        E::Io { what, .. } if *what == "certificate" => cert_field,
        E::Io { .. } | E::NoKey(_) | E::EncryptedKey(_) => key_field,
        E::NoCertificate(_) => cert_field,
        E::Pem { what, .. } if *what == cert.display().to_string() => cert_field,
        E::Pem { .. } => key_field,
        E::Rustls(_) => format!("{cert_field}, {key_field}"),
    };
    format!("{field}: {e}")
}

/// Accepts connections (new and migrated in) and relays each one.
pub async fn serve(listener: TcpListener, svc: Rc<Service>) {
    listener.set_importer(Rc::new(Importer { svc: svc.clone() }));
    if std::env::var_os("CAPYBARA_SIDECAR_DEBUG").is_some() {
        tokio::task::spawn_local(debug::watch(
            listener.stack().clone(),
            listener.local_addr(),
        ));
    }
    loop {
        let (mut stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: sidecar accept: {e}");
                continue;
            }
        };
        let imported = stream
            .take_imported_state()
            .and_then(|b| b.downcast::<Imported>().ok())
            .map(|b| *b);
        tokio::task::spawn_local(run_connection(stream, peer, svc.clone(), imported));
    }
}

/// A migrated-in connection's state, rebuilt before accept.
struct Imported {
    inbuf: Vec<u8>,
    db: Option<u32>,
    tls: Option<TlsServer>,
}

struct Importer {
    svc: Rc<Service>,
}

impl StateImporter for Importer {
    fn import_state(&self, _flow: FlowKey, bytes: &[u8]) -> Result<Box<dyn Any>, String> {
        if let Some(h) = &self.svc.health {
            if h.state() == crate::health::State::Down {
                // Its relay could only answer errors here: the origin
                // keeps the connection (an explicitly named target; the
                // switch's own choices skip this server).
                return Err(format!(
                    "the application at {} is down (health check)",
                    self.svc.backend
                ));
            }
        }
        if bytes.is_empty() {
            // Exported before the sidecar saw it (still in the accept
            // queue): it starts like a new connection, unless TLS is on and
            // the handshake must then happen here.
            return Ok(Box::new(Imported {
                inbuf: Vec::new(),
                db: None,
                tls: match &self.svc.tls {
                    Some(t) => Some(TlsServer::new(&t.current()).map_err(|e| e.to_string())?),
                    None => None,
                },
            }));
        }
        let st = ConnState::parse(bytes).map_err(|e| e.to_string())?;
        if st.protocol != self.svc.protocol {
            return Err(format!(
                "state of a {:?} connection, this service relays {:?}",
                st.protocol, self.svc.protocol
            ));
        }
        if st.tls.is_some() != self.svc.tls.is_some() {
            return Err("TLS state does not match this service's TLS setting".into());
        }
        let tls = match st.tls {
            Some(t) => {
                let seal = self.svc.seal.as_deref().ok_or(
                    "TLS state arrived but this server has no migration secret to open it",
                )?;
                Some(TlsServer::import_sealed(seal, t).map_err(|e| format!("TLS state: {e}"))?)
            }
            None => None,
        };
        Ok(Box::new(Imported {
            inbuf: st.inbuf.to_vec(),
            db: st.db,
            tls,
        }))
    }
}

/// Protocol-specific state of one relayed connection.
enum Proto {
    Http(http1::ResponseTracker),
    Resp(resp::RespConn),
    Raw(raw::RawConn),
}

/// What the relay task and the connection manager share.
struct Shared {
    proto: Proto,
    /// Client bytes (plaintext) read and not yet forwarded: at most one
    /// partial request, plus complete ones while quiesced.
    inbuf: Vec<u8>,
    /// Bytes of complete requests being written to the application.
    to_app: Vec<u8>,
    /// Bytes for the client not yet in the send queue (TLS records, the
    /// sidecar's own error responses).
    to_client: Vec<u8>,
    tls: Option<TlsServer>,
    /// Asked to migrate: forward nothing new.
    quiesced: bool,
    /// Connecting to the application, or setting its connection up.
    connecting: bool,
    /// Closing or failed: not worth migrating.
    closing: bool,
    /// Why this connection cannot migrate at all (protocol modes the
    /// manager cannot carry: upgrades, subscriptions, ...).
    pinned: Option<&'static str>,
    gone: bool,
    waker: Option<Waker>,
    /// The last export cut a TLS record (for the logs and tests).
    mid_record: std::cell::Cell<bool>,
    /// The application connection's descriptor, to check that it has
    /// nothing unread before declaring a safe point.
    app_fd: Option<std::os::fd::RawFd>,
    /// The service's key for sealing exported TLS state.
    seal: Option<std::sync::Arc<capybara_tls::SealKey>>,
    /// The relay's flags for `CAPYBARA_SIDECAR_DEBUG` (see `debug`).
    dbg: debug::RelayDbg,
}

/// Whether the application has sent bytes (or its end) that the relay has
/// not read yet: the relay task may not have run since they arrived.
fn app_has_unread(fd: std::os::fd::RawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: `fd` is the open socket of the relay's application
    // connection (cleared before that connection is dropped); the buffer
    // is valid for one byte.
    let n = unsafe {
        libc::recv(
            fd,
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n >= 0
}

impl Shared {
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    fn readiness(&self) -> Readiness {
        if self.pinned.is_some() || self.closing {
            return Readiness::Never;
        }
        if self.connecting || !self.to_app.is_empty() || !self.to_client.is_empty() {
            return Readiness::NotYet;
        }
        if self.app_fd.is_some_and(app_has_unread) {
            return Readiness::NotYet;
        }
        if let Some(t) = &self.tls {
            if !t.can_export() || t.ciphertext_pending() > 0 {
                return Readiness::NotYet;
            }
        }
        let idle = match &self.proto {
            Proto::Http(t) => t.outstanding() == 0 && t.at_boundary(),
            Proto::Resp(r) => r.idle(),
            Proto::Raw(r) => r.idle(RAW_IDLE, RAW_UNANSWERED, RAW_PIECES_MAX),
        };
        if idle {
            Readiness::Ready
        } else {
            Readiness::NotYet
        }
    }

    fn export(&self, out: &mut Vec<u8>) -> Result<(), String> {
        let mut tls = Vec::new();
        if let Some(t) = &self.tls {
            let seal = self
                .seal
                .as_deref()
                .ok_or("TLS export: no migration secret to seal the TLS state with")?;
            t.export_sealed(seal, rand::random::<[u8; 12]>(), &mut tls)
                .map_err(|e| format!("TLS export: {e}"))?;
            self.mid_record.set(t.partial_record_len() > 0);
        }
        let st = ConnState {
            protocol: match self.proto {
                Proto::Http(_) => SidecarProtocol::Http1,
                Proto::Resp(_) => SidecarProtocol::Resp,
                Proto::Raw(_) => SidecarProtocol::Raw,
            },
            inbuf: &self.inbuf,
            db: match &self.proto {
                Proto::Resp(r) => r.db,
                _ => None,
            },
            tls: self.tls.as_ref().map(|_| &tls[..]),
        };
        st.emit(out);
        Ok(())
    }
}

struct Manager(Rc<RefCell<Shared>>);

impl ConnectionManager for Manager {
    fn prepare(&mut self) -> Readiness {
        let mut sh = self.0.borrow_mut();
        sh.quiesced = true;
        sh.readiness()
    }

    fn export_state(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        self.0.borrow().export(out)
    }

    fn resume(&mut self) {
        let mut sh = self.0.borrow_mut();
        sh.quiesced = false;
        sh.wake();
    }

    fn gone(&mut self) {
        let mut sh = self.0.borrow_mut();
        sh.gone = true;
        sh.wake();
    }
}

/// How a relayed connection ended.
enum End {
    Moved(String),
    Closed,
    Error(String),
}

fn end_of(e: io::Error) -> End {
    match moved_to(&e) {
        Some(t) => End::Moved(t.to_string()),
        None => End::Error(e.to_string()),
    }
}

async fn run_connection(
    client: TcpStream,
    peer: SocketAddrV4,
    svc: Rc<Service>,
    imported: Option<Imported>,
) {
    let migrated_in = imported.is_some();
    let (inbuf, db, tls) = match imported {
        Some(i) => (i.inbuf, i.db, i.tls),
        None => {
            let tls = match &svc.tls {
                Some(t) => match TlsServer::new(&t.current()) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        println!("sidecar peer={peer} error=tls setup: {e}");
                        return;
                    }
                },
                None => None,
            };
            (Vec::new(), None, tls)
        }
    };
    let proto = match svc.protocol {
        SidecarProtocol::Http1 => Proto::Http(http1::ResponseTracker::default()),
        SidecarProtocol::Resp => Proto::Resp(resp::RespConn::new(db)),
        SidecarProtocol::Raw => Proto::Raw(raw::RawConn::new()),
    };
    let handshaking = tls.as_ref().is_some_and(|t| t.is_handshaking());
    let sh = Rc::new(RefCell::new(Shared {
        proto,
        inbuf,
        to_app: Vec::new(),
        to_client: Vec::new(),
        tls,
        quiesced: false,
        connecting: true,
        closing: false,
        pinned: None,
        gone: false,
        waker: None,
        mid_record: Default::default(),
        app_fd: None,
        seal: svc.seal.clone(),
        dbg: Default::default(),
    }));
    debug::register(svc.listen.port(), peer, client.id(), &sh);
    // Registered before the first byte is read, so that no migration can
    // export state the manager does not know about.
    client.set_manager(Box::new(Manager(sh.clone())));

    // The check's evidence before this connect: a refusal below adds to it.
    let trouble_before = svc.health.as_ref().map(|h| h.trouble());
    let app = connect_app(&svc, db).await;
    let app = match app {
        Ok(a) => Some(a),
        Err(e) => {
            svc.app_connect_failed(peer, &e);
            None
        }
    };
    {
        use std::os::fd::AsRawFd;
        let mut s = sh.borrow_mut();
        s.connecting = false;
        s.app_fd = app.as_ref().map(|a| a.as_raw_fd());
    }
    let mut relay = Relay {
        client,
        app,
        sh: sh.clone(),
        svc: svc.clone(),
        buf: svc.relay_buffers.take(),
        client_eof: false,
        app_eof: false,
        app_shut: false,
        fatal: None,
        fatal_sent: false,
        client_shut: false,
        handshaking,
        peer,
        requests: 0,
        orphan: None,
        continue_sent: false,
    };
    if relay.app.is_none() {
        // A connection that migrated in idle owes nothing either way: on a
        // health-checked service it waits as an orphan (its application
        // may have died after this server's check last looked, and the
        // check will move it on) instead of answering an error nobody
        // asked for and closing.
        let kept = migrated_in && {
            let sh_rc = relay.sh.clone();
            let mut sh = sh_rc.borrow_mut();
            relay.orphan(
                &mut sh,
                "migrated in and the application refused the connection",
                trouble_before,
            )
        };
        if !kept {
            relay.backend_failed("refused or unreachable");
        }
    }
    let end = poll_fn(|cx| relay.poll(cx)).await;
    let end = match end {
        End::Closed if relay.client_shut => {
            // Our side is closed; wait (bounded) for the client's, so that
            // closing never resets the client.
            let _ = tokio::time::timeout(CLOSE_LINGER, relay.drain_client()).await;
            End::Closed
        }
        e => e,
    };
    if let (End::Moved(_), Some(app)) = (&end, &relay.app) {
        // Anything the application sends now has nowhere to go: say so
        // (the raw manager's idle heuristic can be wrong; framed ones not).
        let mut probe = [0u8; 1];
        if let Ok(n @ 1..) = app.try_read(&mut probe) {
            println!(
                "sidecar peer={peer} lost: the application sent {n}+ byte(s) after the connection migrated"
            );
        }
    }
    sh.borrow_mut().app_fd = None;
    svc.relay_buffers.give(std::mem::take(&mut relay.buf));
    let requests = relay.requests;
    let mut tag = if migrated_in { " migrated_in=true" } else { "" }.to_string();
    if sh.borrow().mid_record.get() {
        tag.push_str(" mid_record=true");
    }
    match end {
        End::Moved(t) => println!("sidecar peer={peer} requests={requests}{tag} migrated to {t}"),
        End::Closed => println!("sidecar peer={peer} requests={requests}{tag} closed"),
        End::Error(e) => println!("sidecar peer={peer} requests={requests}{tag} error={e}"),
    }
}

/// Opens the loopback connection to the application and restores the
/// connection-scoped settings the manager carries (RESP: the database).
async fn connect_app(svc: &Service, db: Option<u32>) -> io::Result<tokio::net::TcpStream> {
    let mut app = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(std::net::SocketAddr::V4(svc.backend)),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    let _ = app.set_nodelay(true);
    if let Some(db) = db.filter(|&d| d != 0) {
        resp::select_db(&mut app, db).await?;
    }
    Ok(app)
}

/// The log's word for an application that closed an idle connection.
const APP_CLOSED_IDLE: &str = "the application closed the idle connection";

struct Relay {
    client: TcpStream,
    app: Option<tokio::net::TcpStream>,
    sh: Rc<RefCell<Shared>>,
    svc: Rc<Service>,
    buf: Box<[u8]>,
    client_eof: bool,
    app_eof: bool,
    app_shut: bool,
    /// An error response to send once earlier responses are out, then close.
    fatal: Option<Vec<u8>>,
    fatal_sent: bool,
    client_shut: bool,
    handshaking: bool,
    peer: SocketAddrV4,
    requests: u64,
    /// The application closed the connection while idle (`Relay::orphan`).
    orphan: Option<Orphan>,
    /// `100 Continue` sent for the request being received (`http1`).
    continue_sent: bool,
}

/// A relay whose application closed its idle connection, on a service with
/// a health check: the client's connection stays open, migratable (nothing
/// is owed either way). Either the application died (its health check
/// goes down and the connection migrates to a server whose application
/// is up, `crate::health`; or, with no such server, it waits here for the
/// application to come back), or it closed an idle connection on purpose
/// (keep-alive timeout: the relay closes after `grace`, as it did at once
/// before, if every check since then succeeded). A request that comes
/// meanwhile opens a new application connection (refused: the usual
/// error). A connection that migrated in idle and whose first connect was
/// refused starts as one (`run_connection`).
struct Orphan {
    /// Until it ends, the relay cannot tell an application that closed the
    /// connection on purpose from one that died (its check has not probed
    /// enough yet). `None` once it decided to keep the connection.
    grace: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The check's [`crate::health::Check::trouble`] when the application
    /// closed the connection (or before the refused connect): unchanged at
    /// the end of the grace, and the check UP, means the application
    /// answered every check meanwhile, so it closed on purpose. Looking at
    /// the state alone was wrong: an application that died and came back
    /// within the grace (the check DOWN, then UP again) looked like one
    /// that closed on purpose, and connections idle through the outage
    /// were closed (docs/SIDECAR.md, known issues).
    trouble: u64,
    connect: Option<Pin<Box<dyn std::future::Future<Output = io::Result<tokio::net::TcpStream>>>>>,
}

impl Relay {
    fn backend_failed(&mut self, why: &str) {
        let sh_rc = self.sh.clone();
        let mut sh = sh_rc.borrow_mut();
        self.backend_failed_locked(&mut sh, why);
    }

    fn backend_failed_locked(&mut self, sh: &mut Shared, why: &str) {
        let msg = format!("application at {} {why}", self.svc.backend);
        sh.closing = true;
        self.fatal = match sh.proto {
            Proto::Http(_) => Some(http1::error_response(
                502,
                "Bad Gateway",
                &format!("sidecar: {msg}\n"),
            )),
            Proto::Resp(_) => Some(format!("-ERR sidecar: {msg}\r\n").into_bytes()),
            Proto::Raw(_) => Some(Vec::new()),
        };
    }

    /// Runs every direction as far as it goes; `Pending` once nothing can
    /// move (with a waker registered on everything that could).
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<End> {
        let r = self.poll_steps(cx);
        if debug::enabled() {
            let mut sh = self.sh.borrow_mut();
            sh.dbg.requests = self.requests;
            sh.dbg.client_eof = self.client_eof;
            sh.dbg.app_eof = self.app_eof;
            sh.dbg.fatal = self.fatal.is_some();
            sh.dbg.polls += 1;
        }
        r
    }

    fn poll_steps(&mut self, cx: &mut Context<'_>) -> Poll<End> {
        for _ in 0..32 {
            match self.step(cx) {
                Ok(true) => continue,
                Ok(false) => return Poll::Pending,
                Err(end) => return Poll::Ready(end),
            }
        }
        // Still moving: let the driver and the other connections run.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn step(&mut self, cx: &mut Context<'_>) -> Result<bool, End> {
        let sh_rc = self.sh.clone();
        let mut guard = sh_rc.borrow_mut();
        let sh: &mut Shared = &mut guard;
        if sh.gone {
            return Err(End::Moved("another server".into()));
        }
        if !sh.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            sh.waker = Some(cx.waker().clone());
        }
        let mut progress = false;

        // 0. Application connection closed while idle (`Orphan`).
        if self.orphan.is_some() {
            progress |= self.poll_orphan(sh, cx);
        }

        // 1. Bytes the sidecar itself owes the client go first.
        if !sh.to_client.is_empty() {
            match self.client.poll_send_capacity(cx) {
                Poll::Ready(Ok(cap)) => {
                    let n = cap.min(sh.to_client.len());
                    let w = self.client.try_write(&sh.to_client[..n]).map_err(end_of)?;
                    sh.to_client.drain(..w);
                    progress |= w > 0;
                }
                Poll::Ready(Err(e)) => return Err(end_of(e)),
                Poll::Pending => {}
            }
        }

        // 2. Application -> client, no more than the send queue takes now.
        if sh.to_client.is_empty() && !self.app_eof && self.app.is_some() {
            match self.client.poll_send_capacity(cx) {
                Poll::Ready(Ok(cap)) => {
                    let want = if sh.tls.is_some() {
                        cap.min(TLS_CHUNK)
                    } else {
                        cap.min(self.buf.len())
                    };
                    let app = self.app.as_mut().expect("checked above");
                    let mut rb = ReadBuf::new(&mut self.buf[..want]);
                    match Pin::new(app).poll_read(cx, &mut rb) {
                        Poll::Ready(Ok(())) => {
                            let n = rb.filled().len();
                            progress = true;
                            if n == 0 {
                                if !self.orphan(sh, APP_CLOSED_IDLE, None) {
                                    self.app_eof = true;
                                    self.on_app_eof(sh);
                                }
                            } else {
                                // Less than asked for: the application had
                                // nothing more (`raw`: a pause, if more
                                // comes without a request in between).
                                self.relay_from_app(sh, n, n < want)?;
                            }
                        }
                        Poll::Ready(Err(_)) => {
                            progress = true;
                            if !self.orphan(sh, APP_CLOSED_IDLE, None) {
                                self.app_eof = true;
                                self.on_app_eof(sh);
                            }
                        }
                        Poll::Pending => {}
                    }
                }
                Poll::Ready(Err(e)) => return Err(end_of(e)),
                Poll::Pending => {}
            }
        }

        // 3. Client -> sidecar: read only while forwarding is allowed.
        if !sh.quiesced
            && !self.client_eof
            && self.fatal.is_none()
            && sh.inbuf.len() <= self.svc.max_request
        {
            match self.client.poll_read_some(cx, &mut self.buf) {
                Poll::Ready(Ok(0)) => {
                    progress = true;
                    self.client_eof = true;
                    sh.closing = true;
                }
                Poll::Ready(Ok(n)) => {
                    progress = true;
                    self.take_from_client(sh, n);
                }
                Poll::Ready(Err(e)) => return Err(end_of(e)),
                Poll::Pending => {}
            }
        }

        // 4. Frame complete requests and hand them to the application.
        if !sh.quiesced && self.fatal.is_none() && sh.to_app.is_empty() {
            progress |= self.frame_requests(sh);
        }
        if !sh.to_app.is_empty() {
            if let Some(app) = self.app.as_mut() {
                match Pin::new(app).poll_write(cx, &sh.to_app) {
                    Poll::Ready(Ok(n)) => {
                        sh.to_app.drain(..n);
                        progress |= n > 0;
                        if let (Proto::Raw(r), 1..) = (&mut sh.proto, n) {
                            r.to_app();
                        }
                    }
                    Poll::Ready(Err(_)) => {
                        progress = true;
                        sh.to_app.clear();
                        self.app_eof = true;
                        self.on_app_eof(sh);
                    }
                    Poll::Pending => {}
                }
            }
        }

        // 5. The client finished sending: pass the end on once every
        //    complete request is with the application.
        if self.client_eof && !self.app_shut && sh.to_app.is_empty() && self.fatal.is_none() {
            if let Some(app) = self.app.as_mut() {
                if Pin::new(app).poll_shutdown(cx).is_ready() {
                    self.app_shut = true;
                    progress = true;
                }
            } else {
                self.app_shut = true;
            }
        }

        // 6. A fatal error: answer it after the responses before it.
        if let Some(msg) = &self.fatal {
            if !self.fatal_sent
                && sh.to_client.is_empty()
                && (self.outstanding(sh) == 0 || self.app_eof)
            {
                let msg = msg.clone();
                self.fatal_sent = true;
                progress = true;
                self.queue_for_client(sh, &msg);
                if let Some(t) = &mut sh.tls {
                    t.send_close_notify();
                    t.take_ciphertext_to_send(&mut sh.to_client);
                }
            }
        }

        // 7. Close the client side once nothing more can come.
        let app_done = (self.app_eof || self.app.is_none()) && self.orphan.is_none();
        let finished = (app_done && (self.fatal.is_none() || self.fatal_sent))
            || (self.fatal_sent && self.fatal.is_some());
        if finished && sh.to_client.is_empty() && !self.client_shut {
            if let Some(t) = &mut sh.tls {
                if !t.close_sent() {
                    t.send_close_notify();
                    t.take_ciphertext_to_send(&mut sh.to_client);
                    return Ok(true);
                }
            }
            self.client_shut = true;
            sh.closing = true;
            return match self.client.shutdown_write() {
                Ok(()) => Err(End::Closed),
                Err(e) => Err(end_of(e)),
            };
        }
        if self.client_eof && app_done && sh.to_client.is_empty() && self.client_shut {
            return Err(End::Closed);
        }
        Ok(progress)
    }

    fn outstanding(&self, sh: &Shared) -> usize {
        match &sh.proto {
            Proto::Http(t) => t.outstanding(),
            Proto::Resp(r) => r.outstanding,
            Proto::Raw(_) => 0,
        }
    }

    /// Queues bytes for the client (through TLS when on).
    fn queue_for_client(&mut self, sh: &mut Shared, data: &[u8]) {
        let Shared { tls, to_client, .. } = sh;
        match tls {
            Some(t) => {
                if t.write_plaintext(data).is_ok() {
                    t.take_ciphertext_to_send(to_client);
                }
            }
            None => to_client.extend_from_slice(data),
        }
    }

    /// `n` bytes from the application are in `self.buf`; `drained`: its
    /// socket had no more.
    fn relay_from_app(&mut self, sh: &mut Shared, n: usize, drained: bool) -> Result<(), End> {
        let data = &self.buf[..n];
        let observed = match &mut sh.proto {
            Proto::Http(t) => t.observe(data).map(|_| ()),
            Proto::Resp(r) => r.observe(data),
            Proto::Raw(r) => {
                let gap = r.piece_gap();
                let took = r.from_app(drained);
                if debug::enabled() && r.piece_gap() > gap && r.piece_gap() >= RAW_IDLE {
                    // The rule before piece gaps could have cut this answer.
                    println!(
                        "sidecar peer={} raw answer piece after a {} ms pause (past the idle window)",
                        self.peer,
                        r.piece_gap().as_millis()
                    );
                }
                if let Some(took) = took.filter(|t| *t >= RAW_IDLE) {
                    if debug::enabled() {
                        // The old rule (idle after RAW_IDLE either way)
                        // could have migrated the relay before this answer.
                        println!(
                            "sidecar peer={} raw answer after {} ms (past the idle window)",
                            self.peer,
                            took.as_millis()
                        );
                    }
                }
                Ok(())
            }
        };
        if let Err(e) = observed {
            // Output the manager cannot frame: relay it, never migrate.
            if sh.pinned.is_none() {
                println!(
                    "sidecar peer={} application output not framed: {e}",
                    self.peer
                );
            }
            sh.pinned = Some("application output not framed");
        }
        if let Proto::Http(t) = &sh.proto {
            if t.upgraded {
                sh.pinned = Some("protocol upgraded");
            }
        }
        if sh.tls.is_some() {
            let Shared { tls, to_client, .. } = sh;
            let t = tls.as_mut().expect("checked");
            t.write_plaintext(data)
                .map_err(|e| End::Error(format!("tls: {e}")))?;
            t.take_ciphertext_to_send(to_client);
            let w = self.client.try_write(to_client).map_err(end_of)?;
            to_client.drain(..w);
        } else {
            let w = self.client.try_write(data).map_err(end_of)?;
            if w < n {
                sh.to_client.extend_from_slice(&data[w..]);
            }
        }
        Ok(())
    }

    /// `n` bytes from the client are in `self.buf`.
    fn take_from_client(&mut self, sh: &mut Shared, n: usize) {
        let Shared {
            tls,
            inbuf,
            to_client,
            closing,
            proto,
            ..
        } = sh;
        match tls {
            None => inbuf.extend_from_slice(&self.buf[..n]),
            Some(t) => {
                let fed = t.feed_ciphertext(&self.buf[..n]);
                t.take_ciphertext_to_send(to_client);
                if let Err(e) = fed {
                    println!("sidecar peer={} tls error={e}", self.peer);
                    self.fatal = Some(Vec::new());
                    self.fatal_sent = true;
                    *closing = true;
                    return;
                }
                if self.handshaking && !t.is_handshaking() {
                    self.handshaking = false;
                    println!("sidecar peer={} tls handshake complete", self.peer);
                }
                let mut chunk = [0u8; 4096];
                loop {
                    let k = t.read_plaintext(&mut chunk);
                    if k == 0 {
                        break;
                    }
                    inbuf.extend_from_slice(&chunk[..k]);
                }
                if t.peer_closed() {
                    self.client_eof = true;
                    *closing = true;
                }
            }
        }
        if let Proto::Raw(r) = proto {
            r.from_client();
        }
    }

    /// Moves complete requests from `inbuf` to `to_app`. Returns whether
    /// anything moved.
    fn frame_requests(&mut self, sh: &mut Shared) -> bool {
        let max = self.svc.max_request;
        let mut off = 0;
        let mut forwarded = 0;
        let Shared {
            proto,
            inbuf,
            to_app,
            pinned,
            ..
        } = sh;
        loop {
            let rest = &inbuf[off..];
            if rest.is_empty() {
                break;
            }
            if self.app.is_none() {
                // Refused backend: the error answers the first request
                // (orphaned: the request waits for a new connection).
                break;
            }
            let framed: Result<Option<usize>, Vec<u8>> = match proto {
                Proto::Raw(_) => Ok(Some(rest.len())),
                Proto::Http(t) => match http1::parse_request(rest, max) {
                    Ok(Some(r)) => {
                        t.expect(r.head_method);
                        if r.upgrade {
                            *pinned = Some("upgrade requested");
                        }
                        Ok(Some(r.len))
                    }
                    Ok(None) => Ok(None),
                    Err(e) => Err(e.response()),
                },
                Proto::Resp(r) => match resp::parse_command(rest, max) {
                    Ok(Some(c)) => {
                        if let Some(why) = r.forwarded(&c) {
                            *pinned = Some(why);
                        }
                        Ok(Some(c.len))
                    }
                    Ok(None) => Ok(None),
                    Err(e) => Err(e.reply()),
                },
            };
            match framed {
                Ok(Some(len)) => {
                    to_app.extend_from_slice(&rest[..len]);
                    off += len;
                    forwarded += 1;
                }
                Ok(None) => break,
                Err(response) => {
                    println!("sidecar peer={} bad request: closing", self.peer);
                    self.fatal = Some(response);
                    off = inbuf.len();
                    break;
                }
            }
        }
        inbuf.drain(..off);
        if forwarded > 0 {
            self.continue_sent = false;
        }
        // A client that sent `Expect: 100-continue` waits for it before
        // the body, and the request goes to the application only once
        // complete: answer it here (RFC 9110 §10.1.1), once nothing of an
        // earlier response can still come (it would interleave). Without
        // it every such request (curl -T, .NET, libcurl clients) waited
        // for the client's expect timeout, 1 s with curl.
        let send_continue = matches!(proto, Proto::Http(t) if t.outstanding() == 0)
            && !self.continue_sent
            && self.fatal.is_none()
            && self.app.is_some()
            && !inbuf.is_empty()
            && http1::expects_continue(inbuf);
        if !matches!(proto, Proto::Raw(_)) {
            self.requests += forwarded;
        }
        if self.app.is_none() && self.orphan.is_none() && !inbuf.is_empty() && !self.fatal_sent {
            // The backend failed: the error answers the first request.
            inbuf.clear();
        }
        if send_continue && sh.to_client.is_empty() {
            self.continue_sent = true;
            self.queue_for_client(sh, http1::CONTINUE);
            return true;
        }
        off > 0
    }

    /// The application closed (or broke) its connection, or refused the
    /// first one of a connection that migrated in (`what` says which, for
    /// the log): with nothing owed either way on a health-checked service,
    /// keep the client's connection as an [`Orphan`] and ask for a health
    /// probe now. `trouble_before`: the check's evidence counter from
    /// before the event (default: now). Returns whether it did.
    fn orphan(&mut self, sh: &mut Shared, what: &str, trouble_before: Option<u64>) -> bool {
        let Some(h) = &self.svc.health else {
            return false;
        };
        let idle = match &sh.proto {
            Proto::Http(t) => t.outstanding() == 0 && t.at_boundary(),
            Proto::Resp(r) => r.idle(),
            Proto::Raw(_) => false,
        };
        if !idle
            || self.fatal.is_some()
            || self.client_eof
            || sh.closing
            || sh.pinned.is_some()
            || !sh.to_app.is_empty()
        {
            return false;
        }
        // The descriptor goes before the connection it names.
        sh.app_fd = None;
        self.app = None;
        self.orphan = Some(Orphan {
            grace: Some(Box::pin(tokio::time::sleep(h.detect_within))),
            trouble: trouble_before.unwrap_or_else(|| h.trouble()),
            connect: None,
        });
        h.probe_now();
        println!(
            "sidecar peer={} {what}: kept open for a request or a migration",
            self.peer
        );
        true
    }

    /// Advances an [`Orphan`]: a new application connection for a request,
    /// or the end of its grace. Returns whether anything changed.
    fn poll_orphan(&mut self, sh: &mut Shared, cx: &mut Context<'_>) -> bool {
        use std::os::fd::AsRawFd;
        let Some(o) = self.orphan.as_mut() else {
            return false;
        };
        if self.client_eof || sh.closing {
            // The client is done: close as without an orphan.
            self.orphan = None;
            self.app_eof = true;
            sh.connecting = false;
            return true;
        }
        if let Some(c) = o.connect.as_mut() {
            return match c.as_mut().poll(cx) {
                Poll::Ready(Ok(app)) => {
                    sh.app_fd = Some(app.as_raw_fd());
                    self.app = Some(app);
                    sh.connecting = false;
                    self.orphan = None;
                    true
                }
                Poll::Ready(Err(e)) => {
                    self.svc.app_connect_failed(self.peer, &e);
                    sh.connecting = false;
                    self.orphan = None;
                    self.backend_failed_locked(sh, "refused or unreachable");
                    true
                }
                Poll::Pending => false,
            };
        }
        if !sh.inbuf.is_empty() && !sh.quiesced {
            // A request (or part of one): a new application connection.
            let svc = self.svc.clone();
            let db = match &sh.proto {
                Proto::Resp(r) => r.db,
                _ => None,
            };
            o.connect = Some(Box::pin(async move { connect_app(&svc, db).await }));
            sh.connecting = true;
            return true;
        }
        let grace_over = o
            .grace
            .as_mut()
            .is_some_and(|g| std::future::Future::poll(g.as_mut(), cx).is_ready());
        if grace_over {
            o.grace = None;
            let on_purpose =
                self.svc.health.as_ref().is_some_and(|h| {
                    h.state() == crate::health::State::Up && h.trouble() == o.trouble
                });
            if on_purpose {
                // Every check since it closed the connection succeeded:
                // it closed an idle connection on purpose. Close, as the
                // application wanted.
                println!(
                    "sidecar peer={} the application passed every check since it closed the idle connection: closing",
                    self.peer
                );
                self.orphan = None;
                self.app_eof = true;
                sh.closing = true;
                return true;
            }
            // It died (the check failed since, or says down): the
            // connection waits for its migration or, when no server can
            // take it, for the client's next request, which opens a new
            // application connection (answered once the application is
            // back, even if it is back already). No second grace.
            // (`check now up`: the application is back already; the old
            // rule, the state alone, closed these.)
            let now = self
                .svc
                .health
                .as_ref()
                .map_or("off", |h| h.state().as_str());
            println!(
                "sidecar peer={} the application failed its checks since (check now {now}): \
                 kept open until a request, a migration or the client's close",
                self.peer
            );
        }
        false
    }

    fn on_app_eof(&mut self, sh: &mut Shared) {
        sh.closing = true;
        let unanswered = match &mut sh.proto {
            Proto::Http(t) => {
                t.app_closed();
                t.outstanding() > 0 && t.at_boundary()
            }
            Proto::Resp(r) => r.outstanding > 0 && r.at_boundary(),
            Proto::Raw(_) => false,
        };
        if unanswered && self.fatal.is_none() {
            let msg = format!("application at {} closed the connection", self.svc.backend);
            self.fatal = Some(match sh.proto {
                Proto::Http(_) => {
                    http1::error_response(502, "Bad Gateway", &format!("sidecar: {msg}\n"))
                }
                _ => format!("-ERR sidecar: {msg}\r\n").into_bytes(),
            });
        } else if self.fatal.is_none() {
            // Nothing owed: close after what was relayed.
            self.fatal = None;
        }
    }

    /// After our FIN: read and discard until the client's.
    async fn drain_client(&mut self) {
        loop {
            let n = poll_fn(|cx| self.client.poll_read_some(cx, &mut self.buf)).await;
            match n {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    mod tls_reload;

    fn raw_shared(app_fd: std::os::fd::RawFd) -> Shared {
        Shared {
            proto: Proto::Raw(raw::RawConn::new()),
            inbuf: Vec::new(),
            to_app: Vec::new(),
            to_client: Vec::new(),
            tls: None,
            quiesced: true,
            connecting: false,
            closing: false,
            pinned: None,
            gone: false,
            waker: None,
            mid_record: Default::default(),
            app_fd: Some(app_fd),
            seal: None,
            dbg: Default::default(),
        }
    }

    /// Issue #8: a raw relay that wrote a command to a slow application
    /// (over a real loopback connection) must not be a safe point after
    /// `RAW_IDLE`: the answer is owed. It was, the relay migrated, and the
    /// answer (redis-server descheduled for 21 ms under CPU load) was
    /// refused by the closed loopback connection; the client hung.
    #[test]
    fn raw_relay_waiting_for_an_answer_is_not_ready() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut relay_side = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut app_side, _) = l.accept().unwrap();
        let mut sh = raw_shared(relay_side.as_raw_fd());

        // The relay forwards a command; the application reads it and is
        // slow to answer.
        relay_side.write_all(b"PING\r\n").unwrap();
        let sent = std::time::Instant::now();
        if let Proto::Raw(r) = &mut sh.proto {
            r.to_app();
        }
        let mut cmd = [0u8; 6];
        app_side.read_exact(&mut cmd).unwrap();
        std::thread::sleep(RAW_IDLE + Duration::from_millis(5));
        let owed = sh.readiness();
        // (Past RAW_UNANSWERED, on a machine that stalled this thread for
        // a second, Ready would be right.)
        if sent.elapsed() < RAW_UNANSWERED {
            assert_eq!(owed, Readiness::NotYet, "answer owed");
        }

        // The answer arrives: unread, then relayed; then quiet for RAW_IDLE.
        app_side.write_all(b"+PONG\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(sh.readiness(), Readiness::NotYet, "answer unread");
        let mut ans = [0u8; 7];
        relay_side.read_exact(&mut ans).unwrap();
        if let Proto::Raw(r) = &mut sh.proto {
            assert!(r.from_app(true).is_some());
        }
        std::thread::sleep(RAW_IDLE + Duration::from_millis(5));
        assert_eq!(sh.readiness(), Readiness::Ready);
    }

    /// An application that answers in two pieces 30 ms apart (more than
    /// `RAW_IDLE`), over a real loopback connection: once the relay has
    /// seen it do so, its next answer is not a safe point between the
    /// pieces (the old rule, `RAW_IDLE` after any output, cut it there and
    /// the second piece went to a closed connection); it is once the
    /// application has been quiet for twice that pause.
    #[test]
    fn raw_relay_does_not_cut_an_answer_between_its_pieces() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut relay_side = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut app_side, _) = l.accept().unwrap();
        let mut sh = raw_shared(relay_side.as_raw_fd());
        let pause = Duration::from_millis(30);
        let mut buf = vec![0u8; RELAY_CHUNK];
        // The relay reads what is there, as its step 2 does.
        let mut relay_read = |sh: &mut Shared, relay: &mut std::net::TcpStream| {
            let n = relay.read(&mut buf).unwrap();
            assert!(n > 0);
            if let Proto::Raw(r) = &mut sh.proto {
                r.from_app(n < buf.len());
            }
            std::time::Instant::now()
        };
        let ask = |sh: &mut Shared,
                   relay: &mut std::net::TcpStream,
                   app_side: &mut std::net::TcpStream| {
            relay.write_all(b"GET\r\n").unwrap();
            if let Proto::Raw(r) = &mut sh.proto {
                r.to_app();
            }
            let mut cmd = [0u8; 5];
            app_side.read_exact(&mut cmd).unwrap();
            app_side.write_all(b"+first").unwrap();
        };

        // The first answer in pieces: the relay learns the pause.
        ask(&mut sh, &mut relay_side, &mut app_side);
        relay_read(&mut sh, &mut relay_side);
        std::thread::sleep(pause);
        app_side.write_all(b" second\r\n").unwrap();
        let last = relay_read(&mut sh, &mut relay_side);
        let learned = match &sh.proto {
            Proto::Raw(r) => r.piece_gap(),
            _ => unreachable!(),
        };
        assert!(learned >= pause, "learned {learned:?}");
        while last.elapsed() < RAW_IDLE.max((learned * 2).min(RAW_PIECES_MAX)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sh.readiness(), Readiness::Ready, "quiet after the answer");

        // The next one: after its first piece, past RAW_IDLE, the rest is
        // still to come.
        ask(&mut sh, &mut relay_side, &mut app_side);
        let first = relay_read(&mut sh, &mut relay_side);
        std::thread::sleep(RAW_IDLE + Duration::from_millis(5));
        let cut = sh.readiness();
        // (A thread stalled past twice the pause could rightly say Ready.)
        if first.elapsed() < learned * 2 {
            assert_eq!(cut, Readiness::NotYet, "between the pieces of an answer");
        }
        app_side.write_all(b" second\r\n").unwrap();
        let last = relay_read(&mut sh, &mut relay_side);
        // This answer's pause counts too: on a loaded machine (a thread
        // stalled between the pieces) it is the longer one.
        let learned = match &sh.proto {
            Proto::Raw(r) => r.piece_gap(),
            _ => unreachable!(),
        };
        while last.elapsed() < RAW_IDLE.max((learned * 2).min(RAW_PIECES_MAX)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sh.readiness(), Readiness::Ready);
    }

    /// A stack on one end of an in-memory link (the peer's address is its
    /// gateway, so it answers ARP directly).
    fn mem_stack(
        dev: capybara_net::device::memory::MemoryDevice,
        mac: u8,
        ip: std::net::Ipv4Addr,
        peer: std::net::Ipv4Addr,
    ) -> crate::stack::Stack {
        use capybara_net::wire::EthernetAddress;
        let mac = EthernetAddress([2, 0, 0, 0, 0, mac]);
        let iface = capybara_net::Interface::new(capybara_net::InterfaceConfig::new(mac, ip, peer))
            .unwrap();
        let t = crate::stack::Transports::new(
            capybara_tcp::Endpoint::new(capybara_tcp::TcpConfig::default()),
            ip,
        );
        crate::stack::Stack::new(
            iface,
            t,
            Box::new(dev.with_mac(mac)),
            capybara_net::PollMode::Sleep,
        )
    }

    /// A client stack (198.18.0.11) and a server stack (198.18.2.12) on the
    /// two ends of an in-memory link, both driven by local tasks (call it
    /// inside a `LocalSet`): `(client, server, client ip, server ip)`.
    fn linked_stacks() -> (
        crate::stack::Stack,
        crate::stack::Stack,
        std::net::Ipv4Addr,
        std::net::Ipv4Addr,
    ) {
        use std::net::Ipv4Addr;
        let (cip, sip) = (Ipv4Addr::new(198, 18, 0, 11), Ipv4Addr::new(198, 18, 2, 12));
        let (a, b) = capybara_net::device::memory::pair(Default::default());
        let client = mem_stack(a, 1, cip, sip);
        let server = mem_stack(b, 2, sip, cip);
        tokio::task::spawn_local(client.clone().drive());
        tokio::task::spawn_local(server.clone().drive());
        (client, server, cip, sip)
    }

    /// The address of a socket the tests bound to 127.0.0.1.
    fn v4(addr: std::net::SocketAddr) -> SocketAddrV4 {
        match addr {
            std::net::SocketAddr::V4(a) => a,
            _ => unreachable!(),
        }
    }

    /// Opens a connection from the client stack (`cip`, any port) to `to`.
    fn client_connect(
        client: &crate::stack::Stack,
        cip: std::net::Ipv4Addr,
        to: SocketAddrV4,
    ) -> capybara_tcp::ConnId {
        client.with(|i| {
            let now = i.clock.now();
            i.transports
                .tcp
                .connect(now, SocketAddrV4::new(cip, 0), to)
                .unwrap()
        })
    }

    /// Listens on `listen` on the server stack, connects the client stack
    /// to it and accepts (within 10 s): `(listener, client's connection,
    /// accepted stream, its peer)`. Keep the listener as long as the
    /// connection: dropping it unlistens the port.
    async fn connect_through(
        client: &crate::stack::Stack,
        server: &crate::stack::Stack,
        cip: std::net::Ipv4Addr,
        listen: SocketAddrV4,
    ) -> (TcpListener, capybara_tcp::ConnId, TcpStream, SocketAddrV4) {
        let listener = TcpListener::bind(server, listen).unwrap();
        let id = client_connect(client, cip, listen);
        let (stream, peer) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("accepted within 10 s")
            .unwrap();
        (listener, id, stream, peer)
    }

    /// Reads from the client's connection until `until` holds for what
    /// arrived, the stream ends (`true` in the result), or `limit` passes.
    async fn client_read(
        client: &crate::stack::Stack,
        id: capybara_tcp::ConnId,
        limit: Duration,
        until: impl Fn(&[u8]) -> bool,
    ) -> (Vec<u8>, bool) {
        let end = tokio::time::Instant::now() + limit;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while tokio::time::Instant::now() < end && !until(&got) {
            match client.with(|i| i.transports.tcp.recv(id, &mut buf)) {
                Ok(0) => return (got, true),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(capybara_tcp::TcpError::WouldBlock) => {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                Err(e) => panic!("client connection failed: {e:?}"),
            }
        }
        (got, false)
    }

    /// The lab's every-redis-down race (`tests/tests/health_resp_lab.rs`):
    /// s1's health check moved its idle RESP connections to s2, whose
    /// redis-server had died a moment before s2's check noticed. The
    /// migrated-in relay's first connect to the application failed and it
    /// answered `-ERR sidecar: ... refused or unreachable`, nobody having
    /// asked anything, and closed: a connection idle through the outage
    /// was lost. It is an orphan now (nothing is owed either way), and
    /// the next request after the application is back is answered, on
    /// the database the connection had selected. Real stacks over an
    /// in-memory link, a real loopback "application".
    #[test]
    fn an_idle_connection_migrated_in_survives_a_refused_first_connect() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let (client, server, cip, sip) = linked_stacks();

            // Nothing listens on the application's port (it died).
            let app = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let backend = v4(app.local_addr().unwrap());
            drop(app);
            let listen = SocketAddrV4::new(sip, 6379);
            // Checks far apart: the service stays UP for the whole test, as
            // on s2 before its check noticed.
            let cfg = crate::config::HealthConfig {
                interval_ms: 10_000,
                ..Default::default()
            };
            let board = crate::health::Board::new(&cfg, &[(listen, Some(backend))]);
            let svc = Rc::new(Service {
                listen,
                backend,
                protocol: SidecarProtocol::Resp,
                max_request: 1 << 20,
                tls: None,
                seal: None,
                health: board.check_of(listen),
                relay_buffers: RelayBuffers::prewarmed(1),
            });

            let (_listener, id, stream, peer) =
                connect_through(&client, &server, cip, listen).await;
            // As the importer rebuilds an idle connection that had
            // selected database 3.
            let imported = Imported {
                inbuf: Vec::new(),
                db: Some(3),
                tls: None,
            };
            let relay =
                tokio::task::spawn_local(run_connection(stream, peer, svc.clone(), Some(imported)));

            // Nothing comes: no error nobody asked for, no close.
            let (got, ended) =
                client_read(&client, id, Duration::from_millis(300), |g| !g.is_empty()).await;
            assert!(
                got.is_empty() && !ended,
                "an idle migrated-in connection got {:?} (closed: {ended})",
                String::from_utf8_lossy(&got)
            );
            assert!(!relay.is_finished());

            // The application is back; a request comes.
            let app = tokio::net::TcpListener::bind(std::net::SocketAddr::V4(backend))
                .await
                .expect("the application's port again");
            let serve = tokio::task::spawn_local(async move {
                let (mut c, _) = app.accept().await.unwrap();
                let mut seen = Vec::new();
                let mut buf = [0u8; 1024];
                // SELECT 3 first (replayed by the sidecar), then the
                // client's PING.
                while !seen.ends_with(b"PING\r\n") {
                    let n = c.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the sidecar closed: {seen:?}");
                    seen.extend_from_slice(&buf[..n]);
                    if seen.ends_with(b"$1\r\n3\r\n") {
                        c.write_all(b"+OK\r\n").await.unwrap();
                    }
                }
                c.write_all(b"+PONG\r\n").await.unwrap();
                // Held open until the test ends.
                std::future::pending::<()>().await;
                drop(c);
                seen
            });
            client.with(|i| i.transports.tcp.send(id, b"*1\r\n$4\r\nPING\r\n").unwrap());
            let (got, ended) = client_read(&client, id, Duration::from_secs(10), |g| {
                g.ends_with(b"\r\n")
            })
            .await;
            assert_eq!(
                String::from_utf8_lossy(&got),
                "+PONG\r\n",
                "the request after the application came back (closed: {ended})"
            );
            assert!(
                !serve.is_finished(),
                "the application saw SELECT 3 and PING"
            );
            relay.abort();
            serve.abort();
        });
    }

    /// A client that sends `Expect: 100-continue` waits for `100 Continue`
    /// before the body (curl -T, libcurl and .NET clients). The relay
    /// forwards a request only once complete, so the application never saw
    /// the head and nobody answered: every such request waited for the
    /// client's expect timeout (1 s with curl, seen through the demo's VIP).
    /// The relay answers it; the application's own interim 100 (nginx
    /// sends one on seeing the header) passes as an interim response. A
    /// second request on the same connection gets its own. Real stacks
    /// over an in-memory link, a real loopback HTTP "application".
    #[test]
    fn expect_100_continue_is_answered_before_the_body() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let (client, server, cip, sip) = linked_stacks();

            // The application: reads a whole request (head + 5-byte body),
            // answers an interim 100 (as nginx does) and a 200.
            let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let backend = v4(app.local_addr().unwrap());
            let serve = tokio::task::spawn_local(async move {
                let (mut c, _) = app.accept().await.unwrap();
                let mut seen = Vec::new();
                let mut buf = [0u8; 1024];
                for _ in 0..2 {
                    while !seen.ends_with(b"\r\n\r\nhello") {
                        let n = c.read(&mut buf).await.unwrap();
                        assert!(n > 0, "the sidecar closed: {seen:?}");
                        seen.extend_from_slice(&buf[..n]);
                    }
                    seen.clear();
                    c.write_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .unwrap();
                }
                std::future::pending::<()>().await;
                drop(c);
            });
            let listen = SocketAddrV4::new(sip, 80);
            let svc = Rc::new(Service {
                listen,
                backend,
                protocol: SidecarProtocol::Http1,
                max_request: 1 << 20,
                tls: None,
                seal: None,
                health: None,
                relay_buffers: RelayBuffers::prewarmed(1),
            });
            let (_listener, id, stream, peer) =
                connect_through(&client, &server, cip, listen).await;
            let relay = tokio::task::spawn_local(run_connection(stream, peer, svc, None));

            let head = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n";
            for round in 0..2 {
                client.with(|i| i.transports.tcp.send(id, head).unwrap());
                // 10 s: far past any client's expect timeout; without the
                // relay's answer nothing comes at all.
                let (got, ended) = client_read(&client, id, Duration::from_secs(10), |g| {
                    g.ends_with(b"\r\n\r\n")
                })
                .await;
                assert_eq!(
                    String::from_utf8_lossy(&got),
                    "HTTP/1.1 100 Continue\r\n\r\n",
                    "round {round}: before the body (closed: {ended})"
                );
                client.with(|i| i.transports.tcp.send(id, b"hello").unwrap());
                let (got, ended) = client_read(&client, id, Duration::from_secs(10), |g| {
                    g.ends_with(b"\r\n\r\nok")
                })
                .await;
                assert!(
                    got.ends_with(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
                    "round {round}: {:?} (closed: {ended})",
                    String::from_utf8_lossy(&got)
                );
            }
            relay.abort();
            serve.abort();
        });
    }

    /// A tiny RESP application on `listener`: answers `SELECT` with `+OK`
    /// and `PING` with `+PONG` on every connection, and records the
    /// commands it saw (`NAME` or `NAME ARG`) in `seen`. Aborting its task
    /// closes its port and every connection it accepted (it dies).
    async fn resp_app(listener: tokio::net::TcpListener, seen: Rc<RefCell<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            conns.spawn_local(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                loop {
                    match c.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    while let Ok(Some(cmd)) = resp::parse_command(&buf, 1 << 20) {
                        buf.drain(..cmd.len);
                        let answer: &[u8] = match cmd.name.as_str() {
                            "SELECT" => b"+OK\r\n",
                            "PING" => b"+PONG\r\n",
                            _ => b"-ERR unknown\r\n",
                        };
                        seen.borrow_mut().push(match cmd.arg1 {
                            Some(a) => format!("{} {a}", cmd.name),
                            None => cmd.name.clone(),
                        });
                        if c.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    }

    /// The lab's total outage (`tests/tests/health_resp_lab.rs`,
    /// every-redis-down case), one idle RESP connection of it: its
    /// application dies while the connection is idle (the relay keeps it as
    /// an orphan), the health check declares the application DOWN, the
    /// application comes back and the check says UP again, all before the
    /// orphan's grace (`Check::detect_within`) ends. At the end of the
    /// grace the relay used to look only at the check's state, saw UP,
    /// concluded that the application had closed the idle connection on
    /// purpose and closed the client's connection: a connection idle
    /// through the outage was lost (the CI run's 8 clean closes). It must
    /// stay open and answer its next request, on its database. Two ways
    /// in: the application closes the relay's connection as it dies
    /// (`migrated_in = false`), or the connection migrates in idle onto the
    /// dead application and its first connect is refused (`true`). Real
    /// stacks over an in-memory link, a real loopback application; the
    /// check is driven by hand (no probe task), in the order its probes
    /// would see it.
    fn idle_through_an_outage(migrated_in: bool) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let (client, server, cip, sip) = linked_stacks();

            let seen = Rc::new(RefCell::new(Vec::new()));
            let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let backend = v4(app.local_addr().unwrap());
            // Migrated in: the application is already dead.
            let mut app_task = if migrated_in {
                drop(app);
                None
            } else {
                Some(tokio::task::spawn_local(resp_app(app, seen.clone())))
            };
            let listen = SocketAddrV4::new(sip, 6379);
            let board = crate::health::Board::new(
                &crate::config::HealthConfig::default(),
                &[(listen, Some(backend))],
            );
            let check = board.check_of(listen).unwrap();
            let svc = Rc::new(Service {
                listen,
                backend,
                protocol: SidecarProtocol::Resp,
                max_request: 1 << 20,
                tls: None,
                seal: None,
                health: Some(check.clone()),
                relay_buffers: RelayBuffers::prewarmed(1),
            });
            let (_listener, id, stream, peer) =
                connect_through(&client, &server, cip, listen).await;
            let ping = |c: &crate::stack::Stack| {
                c.with(|i| i.transports.tcp.send(id, b"*1\r\n$4\r\nPING\r\n").unwrap());
            };
            let relay = if migrated_in {
                // An idle connection that had selected database 3, as the
                // importer rebuilds it.
                let imported = Imported {
                    inbuf: Vec::new(),
                    db: Some(3),
                    tls: None,
                };
                tokio::task::spawn_local(run_connection(stream, peer, svc.clone(), Some(imported)))
            } else {
                let relay =
                    tokio::task::spawn_local(run_connection(stream, peer, svc.clone(), None));
                // It works, then goes idle.
                ping(&client);
                let (got, _) = client_read(&client, id, Duration::from_secs(10), |g| {
                    g.ends_with(b"\r\n")
                })
                .await;
                assert_eq!(String::from_utf8_lossy(&got), "+PONG\r\n");
                // The application dies: its connections and its port close.
                let t = app_task.take().unwrap();
                t.abort();
                let _ = t.await;
                relay
            };

            // The relay, now an orphan, asks its check for a probe.
            tokio::time::timeout(Duration::from_secs(10), check.probe_requested())
                .await
                .expect("the orphan asks for a probe");
            assert!(!relay.is_finished(), "the relay kept the connection");
            // The probes fail: DOWN (the switch fails open: no target, the
            // connection stays here).
            assert_eq!(check.record_probe(false), None);
            assert_eq!(check.record_probe(false), Some(crate::health::State::Down));
            // The application comes back on its port; the probes succeed:
            // UP, well within the orphan's grace.
            let app = tokio::net::TcpListener::bind(std::net::SocketAddr::V4(backend))
                .await
                .expect("the application's port again");
            let _app_task = tokio::task::spawn_local(resp_app(app, seen.clone()));
            assert_eq!(check.record_probe(true), None);
            assert_eq!(check.record_probe(true), Some(crate::health::State::Up));

            // Past the grace: still open, nothing sent.
            let (got, ended) = client_read(
                &client,
                id,
                check.detect_within + Duration::from_millis(500),
                |g| !g.is_empty(),
            )
            .await;
            assert!(
                got.is_empty() && !ended,
                "a connection idle through the outage got {:?} (closed: {ended}) after the grace",
                String::from_utf8_lossy(&got)
            );
            assert!(!relay.is_finished());

            // Its next request is answered by the application that came
            // back, on the connection's database.
            seen.borrow_mut().clear();
            ping(&client);
            let (got, ended) = client_read(&client, id, Duration::from_secs(10), |g| {
                g.ends_with(b"\r\n")
            })
            .await;
            assert_eq!(
                String::from_utf8_lossy(&got),
                "+PONG\r\n",
                "the request after the application came back (closed: {ended})"
            );
            let want: &[&str] = if migrated_in {
                &["SELECT 3", "PING"]
            } else {
                &["PING"]
            };
            assert_eq!(*seen.borrow(), want);
            relay.abort();
        });
    }

    #[test]
    fn an_idle_connection_survives_an_outage_shorter_than_the_orphan_grace() {
        idle_through_an_outage(false);
    }

    #[test]
    fn an_idle_connection_migrated_onto_a_dead_application_survives_its_return() {
        idle_through_an_outage(true);
    }

    const BASE: &str = "[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\ngateway = \"198.18.1.1\"\n[[service]]\nlisten = \"198.18.100.1:80\"\n";

    fn check(service: &str) -> Result<(), String> {
        let text = format!("{BASE}{service}");
        let c = Config::parse("t.toml", &text).map_err(|e| e.to_string())?;
        c.validate("t.toml").map_err(|e| e.to_string())
    }

    /// `hostagent --check` and the start read the PEM files through
    /// `load_tls`: a file that cannot be loaded names its field and value.
    #[test]
    fn tls_files_that_cannot_be_loaded_name_their_field() {
        let dir = std::env::temp_dir().join(format!("capybara-sidecar-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a pem\n").unwrap();
        let missing = dir.join("missing.pem");
        let load = |cert: &std::path::Path, key: &std::path::Path| {
            let text = format!(
                "{BASE}app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"http1\"\ntls_cert = {:?}\ntls_key = {:?}\n",
                cert.display().to_string(),
                key.display().to_string()
            );
            let c = Config::parse("t.toml", &text).unwrap();
            c.validate("t.toml").unwrap();
            load_tls(&c.services[0]).map(|t| t.is_some())
        };
        let e = load(&junk, &missing).unwrap_err();
        assert!(
            e.starts_with(&format!("tls_key = {:?}", missing.display().to_string())),
            "{e}"
        );
        assert!(e.contains("No such file"), "{e}");
        let e = load(&missing, &junk).unwrap_err();
        assert!(e.starts_with("tls_cert = "), "{e}");
        let e = load(&junk, &junk).unwrap_err();
        assert!(
            e.starts_with("tls_cert = ") && e.contains("no CERTIFICATE block"),
            "{e}"
        );
        let e = load(&dir, &junk).unwrap_err();
        assert!(e.starts_with("tls_cert = "), "{e}");
        // Without TLS fields there is nothing to load.
        let c = Config::parse(
            "t.toml",
            &format!(
                "{BASE}app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"http1\"\n"
            ),
        )
        .unwrap();
        assert!(load_tls(&c.services[0]).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sidecar_config_is_validated_field_by_field() {
        check("app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"http1\"\n").unwrap();
        let e = check("app = \"sidecar\"\nprotocol = \"http1\"\n").unwrap_err();
        assert!(e.contains("service[0].backend"), "{e}");
        let e = check("app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\n").unwrap_err();
        assert!(e.contains("service[0].protocol"), "{e}");
        let e = check("app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"ftp\"\n")
            .unwrap_err();
        assert!(e.contains("ftp"), "{e}");
        let e = check(
            "app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"resp\"\ntls_cert = \"c.pem\"\n",
        )
        .unwrap_err();
        assert!(e.contains("service[0].tls_key"), "{e}");
        let e = check("app = \"echo\"\nbackend = \"127.0.0.1:8080\"\n").unwrap_err();
        assert!(
            e.contains("service[0].backend") && e.contains("sidecar"),
            "{e}"
        );
        let e = check(
            "app = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"raw\"\nmax_request_bytes = 10\n",
        )
        .unwrap_err();
        assert!(e.contains("service[0].max_request_bytes = 10"), "{e}");
    }
}
