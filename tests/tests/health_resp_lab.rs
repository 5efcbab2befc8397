//! Application health checks in the lab for RESP: Debian's redis-server
//! behind the sidecar (`protocol = "resp"`) on two servers, idle Redis
//! client connections held through the real switch (a Python client
//! speaking RESP over raw sockets, half of its connections on database 3).
//!
//! - Server 1's redis-server is killed (SIGKILL): the sidecar keeps the idle
//!   client connections whose loopback connection redis closed (orphans),
//!   the hostagent's health check takes the service down, switchd stops
//!   placing new connections on s1, and the idle connections s1 held
//!   migrate to s2 and keep working (SET/GET answered by s2, on the
//!   database each selected), with no reset. redis comes back: s1 is placed
//!   on again. Then s2's redis closes idle connections on purpose
//!   (`timeout 1`): its check stays up, the sidecar closes them cleanly
//!   after the orphans' grace, nothing migrates.
//! - Every redis-server is down: new and held connections get the
//!   sidecar's `-ERR sidecar: ...` reply or a clean close within bounded
//!   time, never a hang or a reset; the service recovers when redis is back,
//!   and held connections that stayed idle through the outage answer again
//!   (including those moved onto a redis that had died before its server's
//!   check noticed, and those whose orphan grace ended after redis was back:
//!   docs/SIDECAR.md, known issues).
//!
//! Needs root, redis-server, redis-cli, curl and python3 (`make setup`).
//! Run: `cargo test --release -p capybara-systests --test health_resp_lab`.

mod health_common;

use capybara_systests::{metric_sum, switchd_lab, Lab};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use health_common::{backend_up, migrated_out, run_client, switchd_metrics, LineClient};

const VIP: &str = "198.18.100.1";
const PORT: u16 = 6379;
/// Idle connections held across the failure.
const HELD: usize = 16;

/// One lab at a time: the machine has two cores, and two labs with their
/// switchds, hostagents and redis-servers at once only make both slower.
static ONE_LAB: Mutex<()> = Mutex::new(());

/// `hold N`: N connections (connection I selects database 3 when I is
/// odd), one round on each per line read from stdin (`go`: all of them,
/// `go LO HI`: connections LO..HI). `fresh N`: N new
/// connections (the same databases), one round each. A round is a
/// pipelined `SET kI <unique value>`, `GET kI`, `GET whoami` checked
/// against each other: `whoami` is `sJ` in database 0 and `sJ/db3` in
/// database 3 of server J's redis. Every answer is printed as
/// `conn I ok server sJ` or `conn I error KIND DETAIL`, KIND one of `err`
/// (a RESP error reply), `closed` (a clean end of stream), `reset`,
/// `timeout`, `wrong` (a wrong answer), `other`; a connection that failed
/// is closed and answers `error dead -` from then on. A round ends with
/// `done`. Socket timeouts bound every wait.
const CLIENT: &str = r#"
import os, socket, sys
VIP, PORT = "198.18.100.1", 6379
class RespError(Exception):
    pass
class Wrong(Exception):
    pass
def enc(*args):
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a.encode()
        out += b"$%d\r\n" % len(a) + a + b"\r\n"
    return out
class Conn:
    def __init__(self, db, timeout):
        self.s = socket.create_connection((VIP, PORT), timeout=timeout)
        self.buf = b""
        self.db = db
        self.dead = False
        if db:
            self.s.sendall(enc("SELECT", str(db)))
            if self.reply() != "OK":
                raise Wrong("SELECT did not answer OK")
    def fill(self):
        d = self.s.recv(65536)
        if not d:
            raise EOFError("end of stream")
        self.buf += d
    def line(self):
        while b"\r\n" not in self.buf:
            self.fill()
        l, self.buf = self.buf.split(b"\r\n", 1)
        return l.decode(errors="replace")
    def reply(self):
        l = self.line()
        kind, rest = l[:1], l[1:]
        if kind == "-":
            raise RespError(rest)
        if kind == "$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.fill()
            v, self.buf = self.buf[:n], self.buf[n + 2:]
            return v.decode(errors="replace")
        if kind in "+:":
            return rest
        raise Wrong("unexpected reply %r" % l)
    def round(self, i, tag):
        key = "k%d" % i
        val = "%s-%d-%s" % (tag, i, os.urandom(6).hex())
        self.s.sendall(enc("SET", key, val) + enc("GET", key) + enc("GET", "whoami"))
        r1, r2, r3 = self.reply(), self.reply(), self.reply()
        if r1 != "OK":
            raise Wrong("SET answered %r" % r1)
        if r2 != val:
            raise Wrong("GET answered %r, not %r" % (r2, val))
        if r3 is None:
            raise Wrong("no whoami")
        who, _, db = r3.partition("/")
        if db != ("db%d" % self.db if self.db else ""):
            raise Wrong("whoami %r on a connection of database %d" % (r3, self.db))
        return who
def classify(e):
    if isinstance(e, RespError):
        return "err", str(e)
    if isinstance(e, Wrong):
        return "wrong", str(e)
    if isinstance(e, EOFError):
        return "closed", str(e)
    if isinstance(e, socket.timeout):
        return "timeout", str(e)
    if isinstance(e, ConnectionResetError):
        return "reset", str(e)
    return "other", "%s:%s" % (type(e).__name__, e)
def report(i, e):
    kind, detail = classify(e)
    print("conn %d error %s %s" % (i, kind, detail.replace(" ", "_") or "-"), flush=True)
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "hold":
    conns = [Conn(3 if i % 2 else 0, 10) for i in range(n)]
    k = 0
    for line in sys.stdin:
        k += 1
        w = line.split()
        lo, hi = (int(w[1]), int(w[2])) if len(w) == 3 else (0, n)
        for i, c in enumerate(conns):
            if not lo <= i < hi:
                continue
            if c.dead:
                print("conn %d error dead -" % i, flush=True)
                continue
            try:
                print("conn %d ok server %s" % (i, c.round(i, "r%d" % k)), flush=True)
            except Exception as e:
                report(i, e)
                c.dead = True
                c.s.close()
        print("done", flush=True)
else:
    for i in range(n):
        try:
            c = Conn(3 if i % 2 else 0, 5)
            try:
                print("conn %d ok server %s" % (i, c.round(i, "fresh")), flush=True)
            finally:
                c.s.close()
        except Exception as e:
            report(i, e)
    print("done", flush=True)
"#;

fn hostagent_config(dir: &Path, j: u32, key: &Path) -> PathBuf {
    health_common::hostagent_config(
        dir,
        j,
        key,
        &format!("{VIP}:{PORT}"),
        "127.0.0.1:6379",
        "resp",
    )
}

/// redis-server on 127.0.0.1:6379 of server `j` (nothing saved), with
/// `whoami` = `sJ` in database 0 and `sJ/db3` in database 3. Returns its
/// pid once it answers.
fn start_redis(lab: &mut Lab, dir: &Path, j: u32) -> u32 {
    let rdir = dir.join(format!("s{j}-redis"));
    std::fs::create_dir_all(&rdir).unwrap();
    let node = format!("s{j}");
    let pid = lab.spawn_logged(
        &node,
        "redis-server",
        &[
            "--port",
            "6379",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            rdir.to_str().unwrap(),
        ],
        &rdir.join("redis.log"),
    );
    let cli = |args: &[&str]| {
        let mut a = vec!["-h", "127.0.0.1", "-p", "6379"];
        a.extend_from_slice(args);
        lab.try_run(&node, "redis-cli", &a, Duration::from_secs(5))
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    lab.wait_for(
        &format!("redis-server on s{j}"),
        Duration::from_secs(10),
        || cli(&["PING"]) == "PONG",
    );
    let me = format!("s{j}");
    assert_eq!(cli(&["SET", "whoami", &me]), "OK");
    let me3 = format!("s{j}/db3");
    assert_eq!(cli(&["-n", "3", "SET", "whoami", &me3]), "OK");
    pid
}

/// One answer of the client: the server that answered, or the error
/// (`KIND DETAIL`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Ok(String),
    Failed(String, String),
}

fn parse(lines: &[String]) -> Vec<Answer> {
    lines
        .iter()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["conn", _, "ok", "server", who] => Some(Answer::Ok(who.to_string())),
                ["conn", _, "error", kind, detail] => {
                    Some(Answer::Failed(kind.to_string(), detail.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// `HELD` idle connections in the client namespace; killed when dropped.
struct Holder(LineClient);

impl Holder {
    fn start(lab: &Lab) -> Holder {
        Holder(LineClient::start(
            lab,
            CLIENT,
            &["hold", &HELD.to_string()],
            "RESP client",
        ))
    }

    /// One round on every held connection.
    fn round(&mut self) -> Vec<Answer> {
        self.round_on(0..HELD)
    }

    /// One round on the held connections `range`.
    fn round_on(&mut self, range: std::ops::Range<usize>) -> Vec<Answer> {
        parse(&self.0.ask(&format!("go {} {}", range.start, range.end)))
    }
}

/// `n` rounds, each on a new connection.
fn fresh(lab: &Lab, n: usize) -> Vec<Answer> {
    match run_client(lab, CLIENT, &["fresh", &n.to_string()]) {
        Some(lines) => parse(&lines),
        None => vec![Answer::Failed(
            "hang".into(),
            "the client outlived 60 s".into(),
        )],
    }
}

/// `fresh` until all `n` answers satisfy `good`, for at most `limit`.
fn fresh_until(
    lab: &Lab,
    n: usize,
    limit: Duration,
    good: impl Fn(&[Answer]) -> bool,
) -> Vec<Answer> {
    let start = Instant::now();
    loop {
        let a = fresh(lab, n);
        if good(&a) || start.elapsed() >= limit {
            return a;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn count(answers: &[Answer], who: &str) -> usize {
    answers
        .iter()
        .filter(|a| **a == Answer::Ok(who.into()))
        .count()
}

/// The sidecar's error reply or a clean close: what a client may see from
/// a service whose every application is down. Never a reset, a timeout
/// (a hang), a wrong answer.
fn clean_failure(a: &Answer) -> bool {
    match a {
        Answer::Failed(kind, detail) => {
            (kind == "err" && detail.starts_with("ERR_sidecar:")) || kind == "closed"
        }
        Answer::Ok(_) => false,
    }
}

/// How many answers of each kind (`ok sJ`, `err`, `closed`, ...), for the
/// test's output.
fn kinds(answers: &[Answer]) -> String {
    let mut m = std::collections::BTreeMap::new();
    for a in answers {
        let k = match a {
            Answer::Ok(who) => format!("ok {who}"),
            Answer::Failed(kind, _) => kind.clone(),
        };
        *m.entry(k).or_insert(0) += 1;
    }
    format!("{m:?}")
}

fn switchd_backend_up(lab: &Lab, sw: &Path, j: u32, up: bool) -> bool {
    health_common::switchd_backend_up(lab, sw, j, &format!("{VIP}:{PORT}"), up)
}

fn setup(test: &str, tag: &str) -> (Lab, PathBuf, PathBuf, [u32; 3]) {
    let (mut lab, dir, key, sw) = switchd_lab(test, tag, 2);
    let mut t = std::fs::read_to_string(&sw).expect("read switchd config");
    t.push_str(&format!(
        "[[services]]\nname = \"cache\"\nvip = \"{VIP}:{PORT}\"\npool = []\n"
    ));
    std::fs::write(&sw, t).expect("write switchd config");
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let mut redis = [0u32; 3];
    for j in 1..=2u32 {
        redis[j as usize] = start_redis(&mut lab, &dir, j);
        let cfg = hostagent_config(&dir, j, &key);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_registered(&dir.join("switchd.log"), 2);
    lab.wait_for("redis on both servers", Duration::from_secs(30), || {
        let a = fresh(&lab, 8);
        a.len() == 8 && count(&a, "s1") + count(&a, "s2") == 8 && count(&a, "s1") > 0
    });
    assert_eq!(backend_up(&lab, 1), Some(1.0));
    assert_eq!(backend_up(&lab, 2), Some(1.0));
    (lab, dir, sw, redis)
}

/// `HELD` idle connections, all answered, at least one on s1 (Maglev
/// places by the client's port: a set without one on s1 is replaced, a few
/// times). Returns the holder and how many are on s1.
fn hold_some_on_s1(lab: &Lab) -> (Holder, usize) {
    for _ in 0..5 {
        let mut h = Holder::start(lab);
        let a = h.round();
        assert_eq!(a.len(), HELD, "{a:?}");
        assert_eq!(count(&a, "s1") + count(&a, "s2"), HELD, "{a:?}");
        let on_s1 = count(&a, "s1");
        if on_s1 > 0 {
            return (h, on_s1);
        }
    }
    panic!("none of 5 sets of connections had one on s1");
}

#[test]
fn a_dead_redis_leaves_placement_and_its_idle_connections_migrate() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lab, dir, sw, redis) = setup("health_resp_lab_dead", "hrd");
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    let (mut holder, on_s1) = hold_some_on_s1(&lab);
    eprintln!("{on_s1} of {HELD} held connections on s1");
    // They stay idle a moment (a client between commands).
    std::thread::sleep(Duration::from_millis(300));
    let migrated_before = migrated_out(&lab, 1);

    // s1's redis dies: its loopback connections end, the sidecar keeps the
    // idle client connections (orphans), the check declares it down.
    let killed = Instant::now();
    lab.kill_and_wait(redis[1]);
    lab.wait_for("s1 to declare redis down", Duration::from_secs(10), || {
        backend_up(&lab, 1) == Some(0.0)
    });
    lab.wait_for(
        "switchd to take s1 out of the cache's placement",
        Duration::from_secs(10),
        || switchd_backend_up(&lab, &sw, 1, false),
    );
    let detected = killed.elapsed();
    lab.wait_for(
        "s1's idle connections to migrate",
        Duration::from_secs(20),
        || migrated_out(&lab, 1) - migrated_before >= on_s1 as f64,
    );
    let moved = migrated_out(&lab, 1) - migrated_before;
    eprintln!("redis down noticed after {detected:?}; {moved} connection(s) migrated off s1");
    let hl = log("hostagent-s1.log");
    assert!(
        hl.contains(&format!("health: service {VIP}:{PORT} DOWN")),
        "{hl}"
    );
    let orphans = hl
        .matches("the application closed the idle connection: kept open")
        .count();
    assert!(
        orphans >= on_s1,
        "s1's sidecar kept {orphans} orphan(s), {on_s1} were held there:\n{hl}"
    );

    // Every held connection works, now on s2, on the database it selected
    // (the client checks `whoami` per database), with no error.
    let a = holder.round();
    assert_eq!(a.len(), HELD, "{a:?}");
    assert_eq!(
        count(&a, "s2"),
        HELD,
        "every held connection answered by s2: {a:?}"
    );

    // New connections: all to s2, all served, within a bounded time.
    let served = fresh_until(&lab, 20, Duration::from_secs(15), |a| count(a, "s2") == 20);
    assert_eq!(
        count(&served, "s2"),
        20,
        "new connections while s1's redis is down: {served:?}"
    );
    let again = fresh(&lab, 20);
    assert_eq!(count(&again, "s2"), 20, "{again:?}");
    lab.assert_no_resets(1..=2);
    let sl = log("switchd.log");
    assert!(
        sl.contains(&format!("reports the application of {VIP}:{PORT} down")),
        "{sl}"
    );

    // redis comes back on s1: s1 is placed on again; the migrated
    // connections stay where they are and keep working.
    start_redis(&mut lab, &dir, 1);
    lab.wait_for("s1 to declare redis up", Duration::from_secs(15), || {
        backend_up(&lab, 1) == Some(1.0)
    });
    lab.wait_for("switchd to place s1 again", Duration::from_secs(10), || {
        switchd_backend_up(&lab, &sw, 1, true)
    });
    let back = fresh_until(&lab, 20, Duration::from_secs(15), |a| count(a, "s1") > 0);
    assert!(
        count(&back, "s1") > 0,
        "s1 gets new connections again: {back:?}"
    );
    assert_eq!(count(&back, "s1") + count(&back, "s2"), 20, "{back:?}");
    let a = holder.round();
    assert_eq!(
        count(&a, "s2"),
        HELD,
        "the migrated connections stay on s2: {a:?}"
    );
    lab.assert_no_resets(1..=2);
    assert!(log("switchd.log").contains(&format!("reports the application of {VIP}:{PORT} up")));

    // s2's redis closes idle connections on purpose (its `timeout`): the
    // sidecar keeps each a moment (an orphan, in case redis died), its
    // check stays up, so it closes the client's connection as redis
    // wanted: a clean close, no migration, no DOWN, no reset.
    let orphans_before = log("hostagent-s2.log")
        .matches("the application closed the idle connection: kept open")
        .count();
    let migrated_s2 = migrated_out(&lab, 2);
    let set = lab.run(
        "s2",
        "redis-cli",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            "6379",
            "CONFIG",
            "SET",
            "timeout",
            "1",
        ],
        Duration::from_secs(10),
    );
    assert_eq!(String::from_utf8_lossy(&set.stdout).trim(), "OK");
    lab.wait_for(
        "redis on s2 to close the idle connections",
        Duration::from_secs(15),
        || {
            log("hostagent-s2.log")
                .matches("the application closed the idle connection: kept open")
                .count()
                >= orphans_before + HELD
        },
    );
    // The sidecar's FIN, after the orphans' grace (850 ms here): the
    // client has not closed, so each waits in FIN-WAIT.
    lab.wait_for(
        "the sidecar to close the clients' connections",
        Duration::from_secs(10),
        || {
            metric_sum(
                &lab.server_metrics(2),
                "capybara_tcp_connections",
                "state=\"FinWait",
            )
            .unwrap_or(0.0)
                >= HELD as f64
        },
    );
    let a = holder.round();
    assert_eq!(a.len(), HELD, "{a:?}");
    assert!(
        a.iter()
            .all(|x| matches!(x, Answer::Failed(k, _) if k == "closed")),
        "connections redis closed on purpose are closed cleanly: {a:?}"
    );
    assert_eq!(backend_up(&lab, 2), Some(1.0));
    assert_eq!(migrated_out(&lab, 2), migrated_s2);
    assert!(!log("hostagent-s2.log").contains(&format!("health: service {VIP}:{PORT} DOWN")));
    lab.assert_no_resets(1..=2);
}

#[test]
fn every_redis_down_gives_errors_or_closes_never_a_hang() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lab, dir, sw, redis) = setup("health_resp_lab_all", "hra");
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    let (mut holder, on_s1) = hold_some_on_s1(&lab);
    eprintln!("{on_s1} of {HELD} held connections on s1");
    std::thread::sleep(Duration::from_millis(300));

    // Every redis dies: placement fails open, the idle connections have no
    // server to move to and stay where they are, orphaned.
    lab.kill_and_wait(redis[1]);
    lab.kill_and_wait(redis[2]);
    let fail_open = format!("capybara_switchd_service_fail_open{{service=\"{VIP}:{PORT}\"}} 1");
    lab.wait_for("switchd to fail open", Duration::from_secs(10), || {
        switchd_metrics(&lab, &sw).contains(&fail_open)
    });
    assert!(log("switchd.log").contains("placement keeps them all (fail open)"));

    // New connections: the sidecar's error or a close, each within its
    // socket timeout (5 s), none reset.
    let start = Instant::now();
    let errors = fresh(&lab, 10);
    let took = start.elapsed();
    assert_eq!(errors.len(), 10, "{errors:?}");
    assert!(
        errors.iter().all(clean_failure),
        "every new connection gets the sidecar's -ERR or a clean close: {errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|a| matches!(a, Answer::Failed(k, _) if k == "err")),
        "the sidecar says why: {errors:?}"
    );
    assert!(took < Duration::from_secs(20), "10 refusals took {took:?}");
    eprintln!(
        "every redis down: new connections {} in {took:?}",
        kinds(&errors)
    );

    // Held connections: the same, a request on each answers at once. Half
    // of them send one; the other half stay idle through the outage.
    let half = HELD / 2;
    let start = Instant::now();
    let a = holder.round_on(0..half);
    let took = start.elapsed();
    assert_eq!(a.len(), half, "{a:?}");
    assert!(
        a.iter().all(clean_failure),
        "held connections get the sidecar's -ERR or a clean close: {a:?}"
    );
    assert!(took < Duration::from_secs(20), "a round took {took:?}");
    eprintln!(
        "every redis down: held connections {} in {took:?}",
        kinds(&a)
    );
    lab.assert_no_resets(1..=2);

    // redis comes back everywhere: fail open ends, the service serves.
    let mut redis = redis;
    for j in 1..=2 {
        redis[j as usize] = start_redis(&mut lab, &dir, j);
    }
    lab.wait_for("fail open to end", Duration::from_secs(15), || {
        !switchd_metrics(&lab, &sw).contains(&fail_open)
    });
    let fine = fresh_until(&lab, 20, Duration::from_secs(15), |a| {
        count(a, "s1") + count(a, "s2") == 20
    });
    assert_eq!(count(&fine, "s1") + count(&fine, "s2"), 20, "{fine:?}");
    // The connections that stayed idle through the outage were kept
    // (orphans, with no server to move to): a request opens a new
    // connection to redis, on the database the connection selected.
    lab.wait_for("redis up on both servers", Duration::from_secs(15), || {
        backend_up(&lab, 1) == Some(1.0) && backend_up(&lab, 2) == Some(1.0)
    });
    // Past every orphan's grace (850 ms here), so that a connection the
    // sidecar would close has been closed by now.
    std::thread::sleep(Duration::from_millis(1000));
    let a = holder.round_on(half..HELD);
    let count_logs = |what: &str| -> usize {
        (1..=2)
            .map(|j| log(&format!("hostagent-s{j}.log")).matches(what).count())
            .sum()
    };
    // Which server notices first is a race: when s1 does, its orphans move
    // to s2, whose redis is dead too (or dies a moment later), before s2's
    // check says so. They wait there as orphans.
    let kept = count_logs("migrated in and the application refused the connection: kept open");
    // Orphans whose grace ended after redis was back and the check UP
    // again: the sidecar used to take them for connections redis had
    // closed on purpose and closed them (docs/SIDECAR.md, fixed issues).
    let back_in_grace = count_logs("failed its checks since (check now up)");
    eprintln!(
        "idle through the outage: {} ({kept} had moved onto a dead redis, \
         {back_in_grace} orphan(s) saw redis back within their grace)",
        kinds(&a)
    );
    // Every one works again, on its database: none closed, reset, hung or
    // answered wrong.
    assert_eq!(a.len(), HELD - half, "{a:?}");
    assert_eq!(
        count(&a, "s1") + count(&a, "s2"),
        HELD - half,
        "connections idle through the outage work again: {a:?}"
    );
    lab.assert_no_resets(1..=2);

    // Every redis dies again and is restarted as soon as each sidecar has
    // seen its idle connections closed and its check has failed a probe:
    // redis is back, and the checks UP, before the grace of the orphans
    // this makes ends. The relays must not take them for connections
    // redis closed on purpose (they did: the check said UP at the end of
    // the grace). (A redis back before its sidecar even noticed the close
    // looks like one that closed on purpose: docs/SIDECAR.md, limits.)
    let orphans_of = |j: u32| {
        log(&format!("hostagent-s{j}.log"))
            .matches("the application closed the idle connection: kept open")
            .count()
    };
    let failures_of = |lab: &Lab, j: u32| {
        metric_sum(
            &lab.server_metrics(j),
            "capybara_backend_probe_failures_total",
            "",
        )
        .unwrap_or(0.0)
    };
    let before = count_logs("failed its checks since (check now up)");
    let orphans_before = [0, orphans_of(1), orphans_of(2)];
    for j in 1..=2 {
        lab.kill_and_wait(redis[j as usize]);
    }
    let killed = Instant::now();
    lab.wait_for(
        "the sidecars to keep the idle connections",
        Duration::from_secs(10),
        || orphans_of(1) + orphans_of(2) >= orphans_before[1] + orphans_before[2] + (HELD - half),
    );
    // A probe failed after the orphans began (redis is still dead).
    let holding: Vec<u32> = (1..=2)
        .filter(|&j| orphans_of(j) > orphans_before[j as usize])
        .collect();
    let failures_before: Vec<f64> = holding.iter().map(|&j| failures_of(&lab, j)).collect();
    lab.wait_for(
        "the checks to fail a probe",
        Duration::from_secs(10),
        || {
            holding
                .iter()
                .zip(&failures_before)
                .all(|(&j, &f)| failures_of(&lab, j) > f)
        },
    );
    let seen = killed.elapsed();
    for j in 1..=2 {
        redis[j as usize] = start_redis(&mut lab, &dir, j);
    }
    let restarted = killed.elapsed();
    lab.wait_for("redis up on both servers", Duration::from_secs(15), || {
        backend_up(&lab, 1) == Some(1.0) && backend_up(&lab, 2) == Some(1.0)
    });
    let up = killed.elapsed();
    std::thread::sleep(Duration::from_millis(1000));
    let a = holder.round_on(half..HELD);
    eprintln!(
        "quick restart of every redis (outage seen after {seen:?}, back after {restarted:?}, \
         checks up after {up:?}): {} ({} orphan(s) saw redis back within their grace)",
        kinds(&a),
        count_logs("failed its checks since (check now up)") - before
    );
    assert_eq!(a.len(), HELD - half, "{a:?}");
    assert_eq!(
        count(&a, "s1") + count(&a, "s2"),
        HELD - half,
        "connections idle through a quick restart of redis work again: {a:?}"
    );
    lab.assert_no_resets(1..=2);
}
