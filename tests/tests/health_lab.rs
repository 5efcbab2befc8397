//! Application health checks in the lab: nginx behind the sidecar on two
//! servers, keep-alive clients through the real switch. Server 1's nginx is
//! killed: its hostagent's health check takes the service down, switchd
//! stops placing new connections on it, and the idle keep-alive
//! connections it held migrate to server 2 and keep working, with no reset.
//! nginx comes back: server 1 gets new connections again.
//!
//! Needs root, nginx, curl and python3 (`make setup`). Run:
//! `cargo test --release -p capybara-systests --test health_lab`.

mod health_common;

use capybara_systests::{switchd_lab, Lab};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use health_common::{
    backend_up, migrated_out, run_client, switchd_backend_up, switchd_metrics, LineClient,
};

const VIP: &str = "198.18.100.1";
/// Keep-alive connections held across the failure.
const HELD: usize = 16;

/// `hold N`: N keep-alive connections, one GET /whoami on each per line
/// read from stdin. `fresh N`: N new connections, one GET each. Every
/// answer is printed as `conn I status S server X`, or `conn I error E`;
/// a round ends with `done`.
const CLIENT: &str = r#"
import socket, sys
def get(s):
    s.sendall(b"GET /whoami HTTP/1.1\r\nHost: capybara\r\n\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(4096)
        if not d:
            raise EOFError("closed by the server")
        buf += d
    head, body = buf.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ")[1])
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(body) < n:
        d = s.recv(4096)
        if not d:
            raise EOFError("closed in the body")
        body += d
    return status, body[:n].decode(errors="replace").strip().replace(" ", "_") or "-"
def one(i, s):
    try:
        st, who = get(s)
        print("conn %d status %d server %s" % (i, st, who), flush=True)
    except Exception as e:
        print("conn %d error %s" % (i, str(e).replace(" ", "_")), flush=True)
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "hold":
    socks = [socket.create_connection(("198.18.100.1", 80), timeout=10) for _ in range(n)]
    for line in sys.stdin:
        for i, s in enumerate(socks):
            one(i, s)
        print("done", flush=True)
else:
    for i in range(n):
        try:
            s = socket.create_connection(("198.18.100.1", 80), timeout=5)
            one(i, s)
            s.close()
        except Exception as e:
            print("conn %d error %s" % (i, str(e).replace(" ", "_")), flush=True)
    print("done", flush=True)
"#;

fn hostagent_config(dir: &Path, j: u32, key: &Path) -> PathBuf {
    health_common::hostagent_config(dir, j, key, &format!("{VIP}:80"), "127.0.0.1:8080", "http1")
}

/// nginx on 127.0.0.1:8080 of server `j`, serving `/whoami` = `sJ`.
fn nginx_config(dir: &Path, j: u32) -> PathBuf {
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("whoami"), format!("s{j}\n")).unwrap();
    for sub in ["body", "proxy", "fastcgi", "uwsgi", "scgi"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let d = dir.display();
    let t = format!(
        "user root;\ndaemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n fastcgi_temp_path {d}/fastcgi;\n\
          uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n keepalive_requests 1000000;\n keepalive_timeout 300s;\n\
          server {{ listen 127.0.0.1:8080; root {}; }}\n}}\n",
        www.display()
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, t).unwrap();
    path
}

fn start_nginx(lab: &mut Lab, dir: &Path, j: u32) -> u32 {
    let sdir = dir.join(format!("s{j}"));
    std::fs::create_dir_all(&sdir).unwrap();
    let conf = nginx_config(&sdir, j);
    lab.spawn_logged(
        &format!("s{j}"),
        "nginx",
        &["-c", conf.to_str().unwrap(), "-p", sdir.to_str().unwrap()],
        &sdir.join("nginx.out"),
    )
}

/// One answer of the client: the server that answered, or the error.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Ok(String),
    Failed(String),
}

fn parse(lines: &[String]) -> Vec<Answer> {
    lines
        .iter()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["conn", _, "status", "200", "server", who] => Some(Answer::Ok(who.to_string())),
                ["conn", _, "status", st, "server", who] => {
                    Some(Answer::Failed(format!("status {st} from {who}")))
                }
                ["conn", _, "error", e] => Some(Answer::Failed(e.to_string())),
                _ => None,
            }
        })
        .collect()
}

/// `HELD` keep-alive connections in the client namespace; killed when
/// dropped.
struct Holder(LineClient);

impl Holder {
    fn start(lab: &Lab) -> Holder {
        Holder(LineClient::start(
            lab,
            CLIENT,
            &["hold", &HELD.to_string()],
            "keep-alive client",
        ))
    }

    /// One GET on every held connection.
    fn round(&mut self) -> Vec<Answer> {
        parse(&self.0.ask("go"))
    }
}

/// `n` requests, each on a new connection.
fn fresh(lab: &Lab, n: usize) -> Vec<Answer> {
    match run_client(lab, CLIENT, &["fresh", &n.to_string()]) {
        Some(lines) => parse(&lines),
        None => vec![Answer::Failed("the client outlived 60 s".into())],
    }
}

fn count(answers: &[Answer], who: &str) -> usize {
    answers
        .iter()
        .filter(|a| **a == Answer::Ok(who.into()))
        .count()
}

#[test]
fn a_dead_application_leaves_placement_and_its_idle_connections_migrate() {
    let (mut lab, dir, key, sw) = switchd_lab("health_lab", "hl", 2);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let mut nginx = [0u32; 3];
    for j in 1..=2u32 {
        nginx[j as usize] = start_nginx(&mut lab, &dir, j);
        let cfg = hostagent_config(&dir, j, &key);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    lab.wait_registered(&dir.join("switchd.log"), 2);
    lab.wait_for("nginx on both servers", Duration::from_secs(30), || {
        let a = fresh(&lab, 8);
        a.len() == 8 && count(&a, "s1") + count(&a, "s2") == 8 && count(&a, "s1") > 0
    });
    assert_eq!(backend_up(&lab, 1), Some(1.0));

    // Keep-alive connections, some of them on s1 (Maglev places by the
    // client's port: a set without one on s1 is replaced, a few times).
    let mut holder = None;
    let mut on_s1 = 0;
    for _ in 0..5 {
        let mut h = Holder::start(&lab);
        let a = h.round();
        assert_eq!(a.len(), HELD, "{a:?}");
        assert!(a.iter().all(|x| matches!(x, Answer::Ok(_))), "{a:?}");
        on_s1 = count(&a, "s1");
        if on_s1 > 0 {
            holder = Some(h);
            break;
        }
    }
    let mut holder = holder.expect("none of 5 sets of connections had one on s1");
    eprintln!("{on_s1} of {HELD} held connections on s1");
    let migrated_before = migrated_out(&lab, 1);

    // s1's application dies.
    let killed = Instant::now();
    lab.kill_and_wait(nginx[1]);
    lab.wait_for("s1 to declare nginx down", Duration::from_secs(10), || {
        backend_up(&lab, 1) == Some(0.0)
    });
    lab.wait_for(
        "switchd to take s1 out of web's placement",
        Duration::from_secs(10),
        || switchd_backend_up(&lab, &sw, 1, &format!("{VIP}:80"), false),
    );
    let detected = killed.elapsed();
    // The idle connections it held migrate to s2.
    lab.wait_for(
        "s1's idle connections to migrate",
        Duration::from_secs(20),
        || migrated_out(&lab, 1) - migrated_before >= on_s1 as f64,
    );
    let moved = migrated_out(&lab, 1) - migrated_before;
    eprintln!("nginx down noticed after {detected:?}; {moved} connection(s) migrated off s1");
    let a = holder.round();
    assert_eq!(a.len(), HELD, "{a:?}");
    assert_eq!(
        count(&a, "s2"),
        HELD,
        "every held connection answered by s2: {a:?}"
    );

    // New connections: all to s2, all served, within a bounded time.
    let mut served = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        served = fresh(&lab, 20);
        if count(&served, "s2") == 20 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        count(&served, "s2"),
        20,
        "new connections while s1's nginx is down: {served:?}"
    );
    let again = fresh(&lab, 20);
    assert_eq!(count(&again, "s2"), 20, "{again:?}");
    lab.assert_no_resets(1..=2);
    let sl = log("switchd.log");
    assert!(
        sl.contains("reports the application of 198.18.100.1:80 down"),
        "{sl}"
    );
    let hl = log("hostagent-s1.log");
    assert!(hl.contains("health: service 198.18.100.1:80 DOWN"), "{hl}");

    // nginx comes back: s1 is placed on again.
    nginx[1] = start_nginx(&mut lab, &dir, 1);
    lab.wait_for("s1 to declare nginx up", Duration::from_secs(15), || {
        backend_up(&lab, 1) == Some(1.0)
    });
    let mut back = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        back = fresh(&lab, 20);
        if count(&back, "s1") > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
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
    assert!(log("switchd.log").contains("reports the application of 198.18.100.1:80 up"));

    // Every application dies: placement fails open (errors, not silence),
    // nothing hangs, nothing is reset.
    lab.kill_and_wait(nginx[1]);
    lab.kill_and_wait(nginx[2]);
    let fail_open = format!("capybara_switchd_service_fail_open{{service=\"{VIP}:80\"}} 1");
    lab.wait_for("switchd to fail open", Duration::from_secs(10), || {
        switchd_metrics(&lab, &sw).contains(&fail_open)
    });
    let errors = fresh(&lab, 10);
    assert_eq!(errors.len(), 10, "{errors:?}");
    assert!(
        errors
            .iter()
            .all(|a| matches!(a, Answer::Failed(e) if e.starts_with("status 502"))),
        "every new connection gets the sidecar's 502: {errors:?}"
    );
    let a = holder.round();
    assert_eq!(a.len(), HELD, "{a:?}");
    assert!(
        a.iter()
            .all(|x| matches!(x, Answer::Failed(e) if e.starts_with("status 502"))),
        "held connections get the sidecar's 502: {a:?}"
    );
    assert!(log("switchd.log").contains("placement keeps them all (fail open)"));
    for j in 1..=2 {
        start_nginx(&mut lab, &dir, j);
    }
    lab.wait_for("fail open to end", Duration::from_secs(15), || {
        !switchd_metrics(&lab, &sw).contains(&fail_open)
    });
    let mut fine = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        fine = fresh(&lab, 20);
        if count(&fine, "s1") + count(&fine, "s2") == 20 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(count(&fine, "s1") + count(&fine, "s2"), 20, "{fine:?}");
    lab.assert_no_resets(1..=2);
}
