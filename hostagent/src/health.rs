//! Backend health checks: is the application behind each sidecar service
//! (nginx, redis-server, ...) accepting connections?
//!
//! Two kinds of evidence, one state machine per service ([`Tracker`]):
//! - **active**: a control task connects to the service's backend address
//!   over kernel loopback every `[health] interval_ms` (and closes at
//!   once); a connect that fails or takes longer than `timeout_ms` is a
//!   failed check. Never on the per-packet path: the probe is an async
//!   connect on the runtime's control side, like the control channel.
//! - **passive**: a relay whose connect to the application fails counts as
//!   a failed check right away and asks for a probe at once, so with the
//!   default `fall = 2` a dead application is noticed within one failed
//!   request plus one loopback connect, not after a probe interval.
//!
//! `fall` consecutive failed checks take a service DOWN, `rise`
//! consecutive successful probes bring it back UP (passive failures also
//! restart the rise count). Services start UP.
//!
//! On a transition (`transition`): one log line, an immediate HEARTBEAT to the
//! switch (which takes the server out of that service's placement), and
//! the connections of DOWN services migrate away the way a drain moves
//! them ([`crate::drain::Drainer`] restricted to those services). Metrics:
//! [`Board::render_metrics`].

use crate::config::HealthConfig;
use crate::stack::Stack;
use std::cell::{Cell, RefCell};
use std::fmt::Write;
use std::net::SocketAddrV4;
use std::rc::Rc;
use std::time::Duration;

/// A health-driven migration run lasts at most this long; while the
/// service stays down, the next probe starts another (so connections that
/// could not move, e.g. no healthy server anywhere, are retried).
pub const MIGRATE_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Up,
    Down,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Up => "up",
            State::Down => "down",
        }
    }
}

/// The fall/rise state machine of one service (sans-IO).
#[derive(Debug, Clone)]
pub struct Tracker {
    fall: u32,
    rise: u32,
    state: State,
    /// Consecutive failed checks (active or passive).
    fails: u32,
    /// Consecutive successful probes.
    oks: u32,
    pub probes_total: u64,
    pub probe_failures_total: u64,
    pub passive_failures_total: u64,
    pub transitions_total: u64,
}

impl Tracker {
    /// `fall` and `rise` are at least 1.
    pub fn new(fall: u32, rise: u32) -> Tracker {
        Tracker {
            fall: fall.max(1),
            rise: rise.max(1),
            state: State::Up,
            fails: 0,
            oks: 0,
            probes_total: 0,
            probe_failures_total: 0,
            passive_failures_total: 0,
            transitions_total: 0,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// An active probe's result. Returns the new state on a transition.
    pub fn probe(&mut self, ok: bool) -> Option<State> {
        self.probes_total += 1;
        if ok {
            self.fails = 0;
            self.oks = self.oks.saturating_add(1);
            if self.state == State::Down && self.oks >= self.rise {
                return Some(self.set(State::Up));
            }
        } else {
            self.probe_failures_total += 1;
            return self.failed();
        }
        None
    }

    /// A relay could not connect to the application: a failed check.
    pub fn passive_failure(&mut self) -> Option<State> {
        self.passive_failures_total += 1;
        self.failed()
    }

    fn failed(&mut self) -> Option<State> {
        self.oks = 0;
        self.fails = self.fails.saturating_add(1);
        if self.state == State::Up && self.fails >= self.fall {
            return Some(self.set(State::Down));
        }
        None
    }

    fn set(&mut self, s: State) -> State {
        self.state = s;
        self.transitions_total += 1;
        self.fails = 0;
        self.oks = 0;
        s
    }
}

/// The check of one sidecar service, shared by its probe task and its
/// relays (passive evidence).
pub struct Check {
    /// Index of the service in the REGISTER's list (the heartbeat's bit).
    pub index: usize,
    pub listen: SocketAddrV4,
    pub backend: SocketAddrV4,
    /// How long a dead application may take to be declared down (fall
    /// probe intervals plus a timeout, and a margin).
    pub detect_within: Duration,
    tracker: RefCell<Tracker>,
    /// Relay connect failures not yet counted by the probe task.
    pending_passive: Cell<u64>,
    /// Set by a passive failure: probe now.
    wake: tokio::sync::Notify,
    last_error: RefCell<String>,
}

impl Check {
    /// A relay's connect to the application failed (cheap: a counter and a
    /// wake-up; the probe task counts it and probes at once).
    pub fn report_connect_failure(&self) {
        self.pending_passive.set(self.pending_passive.get() + 1);
        self.wake.notify_one();
    }

    /// Probe now, without counting a failure (a relay saw the application
    /// close an idle connection: on purpose, or because it died).
    pub fn probe_now(&self) {
        self.wake.notify_one();
    }

    pub fn state(&self) -> State {
        self.tracker.borrow().state()
    }

    /// A count that grows with every failed check of the application
    /// (probes, and relay connects, counted or still pending) and every
    /// transition: the same value at two readings means the application
    /// answered every check in between and the state did not change. The
    /// sidecar's orphans tell with it an application that closed an idle
    /// connection on purpose (its checks all succeed) from one that died,
    /// even when it is back (UP again) by the time they decide.
    pub fn trouble(&self) -> u64 {
        let t = self.tracker.borrow();
        t.probe_failures_total
            + t.passive_failures_total
            + t.transitions_total
            + self.pending_passive.get()
    }
}

#[cfg(test)]
impl Check {
    /// An active probe's result, as the probe task records it (tests drive
    /// the state machine with it instead of a probe task).
    pub(crate) fn record_probe(&self, ok: bool) -> Option<State> {
        self.tracker.borrow_mut().probe(ok)
    }

    /// Waits until something asked for a probe (a relay's failed connect,
    /// an orphan), as the probe task does.
    pub(crate) async fn probe_requested(&self) {
        self.wake.notified().await
    }
}

/// Every health check of this hostagent.
pub struct Board {
    pub cfg: HealthConfig,
    pub checks: Vec<Rc<Check>>,
    /// Notified on every transition: the control channel sends a HEARTBEAT
    /// at once.
    pub changed: tokio::sync::Notify,
}

impl Board {
    /// One check per sidecar service; `services` is the REGISTER list
    /// (listen address, backend for sidecars).
    pub fn new(cfg: &HealthConfig, services: &[(SocketAddrV4, Option<SocketAddrV4>)]) -> Board {
        let checks = if cfg.enabled {
            services
                .iter()
                .enumerate()
                .filter_map(|(index, (listen, backend))| {
                    Some(Rc::new(Check {
                        index,
                        listen: *listen,
                        backend: (*backend)?,
                        detect_within: Duration::from_millis(
                            cfg.interval_ms * u64::from(cfg.fall) + cfg.timeout_ms + 250,
                        ),
                        tracker: RefCell::new(Tracker::new(cfg.fall, cfg.rise)),
                        pending_passive: Cell::new(0),
                        wake: tokio::sync::Notify::new(),
                        last_error: RefCell::new(String::new()),
                    }))
                })
                .collect()
        } else {
            Vec::new()
        };
        Board {
            cfg: cfg.clone(),
            checks,
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The check of the service at `listen`, if it has one.
    pub fn check_of(&self, listen: SocketAddrV4) -> Option<Rc<Check>> {
        self.checks.iter().find(|c| c.listen == listen).cloned()
    }

    /// REGISTER-list indexes of the services that are down.
    pub fn down_indexes(&self) -> impl Iterator<Item = usize> + '_ {
        self.checks
            .iter()
            .filter(|c| c.state() == State::Down)
            .map(|c| c.index)
    }

    /// The service addresses that are down.
    pub fn down_services(&self) -> Vec<SocketAddrV4> {
        self.checks
            .iter()
            .filter(|c| c.state() == State::Down)
            .map(|c| c.listen)
            .collect()
    }

    /// The HEARTBEAT flags reporting health (0 when checks are off, as an
    /// older hostagent sends).
    pub fn heartbeat_flags(&self) -> u32 {
        if !self.cfg.enabled {
            return 0;
        }
        capybara_proto::control::Heartbeat::health_flags(self.down_indexes())
    }

    /// Prometheus text: state, probes, failures and transitions per service.
    pub fn render_metrics(&self, l: &str, s: &mut String) {
        if self.checks.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "# TYPE capybara_backend_up gauge\n# TYPE capybara_backend_probes_total counter\n\
             # TYPE capybara_backend_probe_failures_total counter\n\
             # TYPE capybara_backend_passive_failures_total counter\n\
             # TYPE capybara_backend_transitions_total counter"
        );
        for c in &self.checks {
            let t = c.tracker.borrow();
            let sl = format!("{l},service=\"{}\",backend=\"{}\"", c.listen, c.backend);
            let up = u8::from(t.state() == State::Up);
            let _ = writeln!(
                s,
                "capybara_backend_up{{{sl}}} {up}\n\
                 capybara_backend_probes_total{{{sl}}} {}\n\
                 capybara_backend_probe_failures_total{{{sl}}} {}\n\
                 capybara_backend_passive_failures_total{{{sl}}} {}\n\
                 capybara_backend_transitions_total{{{sl}}} {}",
                t.probes_total,
                t.probe_failures_total,
                t.passive_failures_total,
                t.transitions_total
            );
        }
    }
}

/// Spawns one probe task per check (on the current `LocalSet`).
pub fn spawn(stack: Stack, board: Rc<Board>) {
    if !board.cfg.enabled {
        return;
    }
    for c in board.checks.clone() {
        tokio::task::spawn_local(probe_loop(stack.clone(), board.clone(), c));
    }
}

async fn probe_loop(stack: Stack, board: Rc<Board>, c: Rc<Check>) {
    let interval = Duration::from_millis(board.cfg.interval_ms);
    let timeout = Duration::from_millis(board.cfg.timeout_ms);
    eprintln!(
        "hostagent: health check of {} (backend {}): every {} ms, timeout {} ms, fall {}, rise {}",
        c.listen,
        c.backend,
        board.cfg.interval_ms,
        board.cfg.timeout_ms,
        board.cfg.fall,
        board.cfg.rise
    );
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = c.wake.notified() => {}
        }
        let passive = c.pending_passive.replace(0);
        for _ in 0..passive.min(u64::from(board.cfg.fall)) {
            let t = c.tracker.borrow_mut().passive_failure();
            if let Some(s) = t {
                *c.last_error.borrow_mut() = "a relay could not connect".into();
                transition(&stack, &board, &c, s);
            }
        }
        if passive > u64::from(board.cfg.fall) {
            // Counted, but not one state-machine step each.
            c.tracker.borrow_mut().passive_failures_total += passive - u64::from(board.cfg.fall);
        }
        let result = match tokio::time::timeout(
            timeout,
            tokio::net::TcpStream::connect(std::net::SocketAddr::V4(c.backend)),
        )
        .await
        {
            Ok(Ok(s)) => {
                drop(s);
                Ok(())
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", board.cfg.timeout_ms)),
        };
        let ok = result.is_ok();
        if let Err(e) = result {
            *c.last_error.borrow_mut() = e;
        }
        let t = c.tracker.borrow_mut().probe(ok);
        if let Some(s) = t {
            transition(&stack, &board, &c, s);
        } else if c.state() == State::Down {
            // Still down: keep moving what can move (connections that
            // arrived meanwhile, or that found no target last time).
            steer(&stack, &board, false);
        }
    }
}

fn transition(stack: &Stack, board: &Board, c: &Check, s: State) {
    match s {
        State::Down => eprintln!(
            "hostagent: health: service {} DOWN: backend {} failed {} check(s) in a row (last: {}); \
             out of placement, its idle connections migrate away",
            c.listen,
            c.backend,
            board.cfg.fall,
            c.last_error.borrow()
        ),
        State::Up => eprintln!(
            "hostagent: health: service {} UP: backend {} answered {} probe(s) in a row",
            c.listen, c.backend, board.cfg.rise
        ),
    }
    board.changed.notify_one();
    steer(stack, board, true);
}

/// Starts (or updates, or ends) the migration of the down services'
/// connections.
fn steer(stack: &Stack, board: &Board, changed: bool) {
    let down = board.down_services();
    stack.with(|i| {
        let now = i.clock.now();
        let Some(m) = i.transports.mig.as_mut() else {
            return;
        };
        let d = &mut i.transports.health_drain;
        if down.is_empty() {
            d.cancel(now);
        } else if changed || !d.active() {
            d.start_for(now, MIGRATE_DEADLINE, m, &down);
        }
        i.kick();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn falls_after_fall_failures_and_rises_after_rise_successes() {
        let mut t = Tracker::new(2, 3);
        assert_eq!(t.state(), State::Up);
        assert_eq!(t.probe(false), None);
        assert_eq!(t.probe(true), None, "a success in between resets the fall");
        assert_eq!(t.probe(false), None);
        assert_eq!(t.probe(false), Some(State::Down));
        assert_eq!(t.probe(false), None, "already down");
        assert_eq!(t.probe(true), None);
        assert_eq!(t.probe(true), None);
        assert_eq!(t.probe(false), None, "a failure resets the rise");
        assert_eq!(t.probe(true), None);
        assert_eq!(t.probe(true), None);
        assert_eq!(t.probe(true), Some(State::Up));
        assert_eq!(t.transitions_total, 2);
        assert_eq!(t.probes_total, 11);
        assert_eq!(t.probe_failures_total, 5);
    }

    #[test]
    fn passive_failures_count_at_once() {
        let mut t = Tracker::new(2, 2);
        // One failed request and one failed probe: down.
        assert_eq!(t.passive_failure(), None);
        assert_eq!(t.probe(false), Some(State::Down));
        // Two failed requests alone: down too.
        let mut t = Tracker::new(2, 2);
        assert_eq!(t.passive_failure(), None);
        assert_eq!(t.passive_failure(), Some(State::Down));
        assert_eq!(t.passive_failures_total, 2);
        // While rising, a failed request restarts the rise.
        assert_eq!(t.probe(true), None);
        assert_eq!(t.passive_failure(), None);
        assert_eq!(t.probe(true), None);
        assert_eq!(t.probe(true), Some(State::Up));
        // Fall 1: the first failed request takes it down.
        let mut t = Tracker::new(1, 1);
        assert_eq!(t.passive_failure(), Some(State::Down));
        assert_eq!(t.probe(true), Some(State::Up));
    }

    #[test]
    fn trouble_grows_with_every_failed_check_and_transition_only() {
        let a = SocketAddrV4::new(std::net::Ipv4Addr::new(198, 18, 100, 1), 6379);
        let b = Some(SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 6379));
        let board = Board::new(&HealthConfig::default(), &[(a, b)]);
        let c = board.check_of(a).unwrap();
        let t0 = c.trouble();
        // Successful probes: no trouble (an application that closed an
        // idle connection on purpose).
        assert_eq!(c.record_probe(true), None);
        assert_eq!(c.trouble(), t0);
        // A relay's failed connect counts at once, before the probe task
        // has counted it, and not twice once it has.
        c.report_connect_failure();
        let t1 = c.trouble();
        assert!(t1 > t0);
        let pending = c.pending_passive.replace(0);
        c.tracker.borrow_mut().passive_failures_total += pending;
        assert_eq!(c.trouble(), t1);
        // Down and up again: the count moved, though the state is UP as
        // before (an application that died and came back).
        let t2 = c.trouble();
        while c.record_probe(false).is_none() {}
        while c.record_probe(true).is_none() {}
        assert_eq!(c.state(), State::Up);
        assert!(c.trouble() > t2);
    }

    #[test]
    fn thresholds_below_one_mean_one() {
        let mut t = Tracker::new(0, 0);
        assert_eq!(t.probe(false), Some(State::Down));
        assert_eq!(t.probe(true), Some(State::Up));
    }

    #[test]
    fn the_board_reports_down_services_in_heartbeat_bits() {
        use capybara_proto::control::{Heartbeat, HEARTBEAT_HEALTH};
        let a = |p| SocketAddrV4::new(std::net::Ipv4Addr::new(198, 18, 100, 1), p);
        let b = |p| Some(SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, p));
        let cfg = HealthConfig::default();
        // Service 0 has no backend (not a sidecar): no check.
        let board = Board::new(&cfg, &[(a(7), None), (a(80), b(8080)), (a(6379), b(6379))]);
        assert_eq!(board.checks.len(), 2);
        assert_eq!(board.heartbeat_flags(), HEARTBEAT_HEALTH);
        let c = board.check_of(a(6379)).unwrap();
        for _ in 0..cfg.fall {
            c.tracker.borrow_mut().passive_failure();
        }
        assert_eq!(board.down_services(), vec![a(6379)]);
        let hb = Heartbeat {
            connections: 0,
            migrations_in_flight: 0,
            load_pps: 0,
            rx_backlog_bytes: 0,
            flags: board.heartbeat_flags(),
            policy_generation: 0,
        };
        assert!(hb.backend_down(2) && !hb.backend_down(1) && !hb.backend_down(0));
        let mut m = String::new();
        board.render_metrics("server=\"s1\"", &mut m);
        assert!(m.contains(
            "capybara_backend_up{server=\"s1\",service=\"198.18.100.1:6379\",backend=\"127.0.0.1:6379\"} 0"
        ));
        assert!(m.contains("capybara_backend_passive_failures_total{server=\"s1\",service=\"198.18.100.1:6379\",backend=\"127.0.0.1:6379\"} 2"));
        // Switched off: no checks, and the heartbeat says nothing.
        let off = Board::new(
            &HealthConfig {
                enabled: false,
                ..cfg
            },
            &[(a(80), b(8080))],
        );
        assert!(off.checks.is_empty());
        assert_eq!(off.heartbeat_flags(), 0);
    }
}
