//! `make demo` end to end (root; release binaries, or `CAPYBARA_BIN_DIR`):
//! runs `scripts/demo.sh` beside any developer demo (its own lab prefix,
//! API port and state/output dirs through the `CAPYBARA_*` knobs), checks
//! the dashboard and the API from the host, that the servers carry the
//! client load and that the policies migrate connections without anyone
//! asking, that switchd pins its XDP links in the lab's bpffs directory
//! (it sees bpffs: a restart would take them over in place), then stops
//! the demo (SIGTERM, as `make demo-stop` does) and checks that nothing of
//! it remains: no namespace, no process, no pin.

use capybara_systests::{bin, output_dir};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `curl -s` with a time limit; returns (HTTP status, body).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-m", "5", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

fn namespaces(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(str::to_string)
        .collect()
}

/// Processes of the demo: inside one of its namespaces, or naming its
/// state dir or namespaces on their command line (the relay, the script).
fn demo_processes(prefix: &str, dir: &Path) -> BTreeSet<u32> {
    let inodes: BTreeSet<u64> = namespaces(prefix)
        .iter()
        .filter_map(|n| {
            use std::os::unix::fs::MetadataExt;
            Some(std::fs::metadata(format!("/run/netns/{n}")).ok()?.ino())
        })
        .collect();
    let me = std::process::id();
    let dir = dir.display().to_string();
    let ns_arg = format!("/run/netns/{prefix}-");
    let mut pids = BTreeSet::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let in_ns = std::fs::read_link(format!("/proc/{pid}/ns/net"))
            .ok()
            .and_then(|l| {
                let l = l.to_string_lossy().to_string();
                l.trim_start_matches("net:[")
                    .trim_end_matches(']')
                    .parse::<u64>()
                    .ok()
            })
            .is_some_and(|ino| inodes.contains(&ino));
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        if in_ns || cmd.contains(&dir) || cmd.contains(&ns_arg) {
            pids.insert(pid);
        }
    }
    pids
}

fn alive(pid: u32) -> bool {
    // A zombie has no cmdline left; it is gone for our purposes.
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

/// The running demo script; stopped (SIGTERM, then its own teardown) on drop.
struct Demo {
    child: Option<Child>,
    prefix: String,
}

impl Demo {
    fn start(log: &Path, prefix: &str, port: u16, dir: &Path, out: &Path, seconds: u64) -> Demo {
        let f = std::fs::File::create(log).expect("create demo log");
        let mut c = Command::new("bash");
        c.arg("scripts/demo.sh")
            .current_dir(root())
            .env("CAPYBARA_DEMO_SECONDS", seconds.to_string())
            .env("CAPYBARA_LAB_PREFIX", prefix)
            .env("CAPYBARA_DEMO_PORT", port.to_string())
            .env("CAPYBARA_DEMO_DIR", dir)
            .env("CAPYBARA_DEMO_OUT", out)
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        // The script looks for binaries in CAPYBARA_BIN_DIR first, then
        // target/release: point it where this test found them.
        if std::env::var_os("CAPYBARA_BIN_DIR").is_none() {
            if let Some(dir) = bin("capybara").parent() {
                c.env("CAPYBARA_BIN_DIR", dir);
            }
        }
        Demo {
            child: Some(c.spawn().expect("start scripts/demo.sh")),
            prefix: prefix.to_string(),
        }
    }

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().expect("wait").is_none())
    }

    /// SIGTERM (what `make demo-stop` sends) and waits for the teardown.
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if let Some(st) = c.try_wait().expect("wait") {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = c.kill();
        c.wait().ok()
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop();
            let _ = Command::new(bin("capybara"))
                .args(["lab", "down", "--prefix", &self.prefix])
                .output();
        }
    }
}

fn wait_for(
    what: &str,
    limit: Duration,
    demo: &mut Demo,
    log: &Path,
    mut cond: impl FnMut() -> bool,
) {
    let start = Instant::now();
    while !cond() {
        assert!(
            demo.running(),
            "the demo exited while waiting for {what}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// switchd's `pin_dir` in its `/status` (empty when not pinned).
fn switchd_pin_dir(prefix: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &format!("{prefix}-sw")])
        .args(["curl", "-s", "-m", "2", "http://127.0.0.1:9102/status"])
        .output()
        .expect("curl switchd's /status");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["pin_dir"].as_str().unwrap_or("").to_string()
}

/// PREPARE-ACKs switchd forwarded (each one installs a migration-table
/// entry: a migration that reached its second phase).
fn prepare_acks(prefix: &str) -> u64 {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &format!("{prefix}-sw"),
            "curl",
            "-s",
            "-m",
            "2",
            "http://127.0.0.1:9102/metrics",
        ])
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("reason=\"fwd_prepare_ack\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// (server name, connections) of every server in a /v1/servers body.
fn servers_connections(body: &str) -> Vec<(String, u64)> {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let list = v
        .get("servers")
        .or(v.get("items"))
        .and_then(|l| l.as_array().cloned())
        .or_else(|| v.as_array().cloned())
        .unwrap_or_default();
    list.iter()
        .map(|s| {
            (
                s.get("name")
                    .and_then(|n| n.as_str())
                    .unwrap_or("?")
                    .to_string(),
                s.pointer("/stats/connections")
                    .and_then(|c| c.as_u64())
                    .unwrap_or(0),
            )
        })
        .collect()
}

#[test]
fn demo_serves_the_dashboard_rebalances_and_tears_down() {
    let out = output_dir("demo_test");
    let log = out.join("demo.log");
    let dir = out.join("state");
    let demo_out = out.join("out");
    let prefix = format!("dm{}", std::process::id() % 100_000);
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let mut demo = Demo::start(&log, &prefix, port, &dir, &demo_out, 110);

    wait_for(
        "the demo's banner",
        Duration::from_secs(90),
        &mut demo,
        &log,
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("Press Ctrl-C")
        },
    );
    let token = std::fs::read_to_string(demo_out.join("admin-token")).expect("admin token file");
    let auth = format!("Authorization: Bearer {}", token.trim());
    let demo_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        demo_log.contains(&api),
        "no dashboard URL printed:\n{demo_log}"
    );
    assert!(
        demo_log.contains(token.trim()),
        "the admin token was not printed:\n{demo_log}"
    );

    // The dashboard.
    let (code, index) = curl(&[&format!("{api}/")]);
    assert_eq!(code, 200);
    let expected = std::fs::read_to_string(root().join("web-ui/dist/index.html"))
        .expect("web-ui/dist/index.html");
    assert_eq!(
        index.trim(),
        expected.trim(),
        "/ is not the dashboard's index.html"
    );
    let (code, health) = curl(&[&format!("{api}/healthz")]);
    assert_eq!(code, 200, "{health}");
    assert!(health.contains("\"control_plane\":\"switchd\""), "{health}");
    let lab_bpf = format!("/sys/fs/bpf/capybara-lab-{prefix}");
    let pins = switchd_pin_dir(&prefix);
    assert!(
        pins.starts_with(&format!("{lab_bpf}/switchd/")),
        "switchd pins its XDP links in the lab's directory {lab_bpf}/switchd: pin_dir {pins:?}"
    );

    // The API: three servers, all carrying client connections.
    let mut servers = String::new();
    wait_for(
        "3 servers with connections in /v1/servers",
        Duration::from_secs(30),
        &mut demo,
        &log,
        || {
            let (code, body) = curl(&["-H", &auth, &format!("{api}/v1/servers")]);
            servers = body;
            let conns = servers_connections(&servers);
            code == 200 && conns.len() == 3 && conns.iter().all(|(_, c)| *c > 0)
        },
    );
    assert!(servers.contains("\"data_source\":\"switchd\""), "{servers}");
    println!(
        "connections per server: {:?}",
        servers_connections(&servers)
    );

    // Its configured service is in the store (switchd writes it there), so
    // the dashboard's Services page and the connections list name it.
    let (code, services) = curl(&["-H", &auth, &format!("{api}/v1/services")]);
    assert_eq!(code, 200, "{services}");
    assert!(
        services.contains("\"name\":\"web\"") && services.contains("\"vip\":\"198.18.100.1\""),
        "GET /v1/services: {services}"
    );
    let (code, conns) = curl(&["-H", &auth, &format!("{api}/v1/connections?limit=5")]);
    assert!(
        code == 200 && conns.contains("\"service\":\"web\""),
        "GET /v1/connections: {code} {conns}"
    );

    // The demo application answers through the VIP (nginx behind the sidecar).
    let page = Command::new("ip")
        .args(["netns", "exec", &format!("{prefix}-c1")])
        .args(["curl", "-s", "-m", "5", "http://198.18.100.1/"])
        .output()
        .expect("curl the VIP");
    let page = String::from_utf8_lossy(&page.stdout);
    assert!(
        page.contains("nginx behind the hostagent sidecar"),
        "{page}"
    );

    // The policies migrate connections on their own.
    let before = prepare_acks(&prefix);
    let mut after = before;
    wait_for(
        "policy migrations (switchd's fwd_prepare_ack counter)",
        Duration::from_secs(40),
        &mut demo,
        &log,
        || {
            after = prepare_acks(&prefix);
            after > before
        },
    );
    // ... and the operators see them: the servers report every finished
    // migration (MIGRATION_REPORT), the API lists it with its trigger.
    let mut migrations = String::new();
    wait_for(
        "policy migrations listed in GET /v1/migrations",
        Duration::from_secs(20),
        &mut demo,
        &log,
        || {
            let (code, body) = curl(&["-H", &auth, &format!("{api}/v1/migrations?limit=1000")]);
            migrations = body;
            code == 200
                && (migrations.contains("\"trigger\":\"proactive\"")
                    || migrations.contains("\"trigger\":\"reactive\""))
        },
    );
    assert!(migrations.contains("\"total_us\":"), "{migrations}");
    println!("fwd_prepare_ack {before} -> {after}");
    println!(
        "GET /v1/migrations: {}",
        &migrations[..migrations.len().min(600)]
    );

    // A server's hostagent dying (docs/OPERATIONS.md, "Server stalls and
    // restarts") is a failure to watch, not the end of the demo: it says
    // which process died and how to start it again, and goes on.
    let config = dir.join("hostagent-s3.toml").display().to_string();
    let hostagent = demo_processes(&prefix, &dir)
        .into_iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .is_ok_and(|c| c.contains("--config") && c.contains(&config))
        })
        .expect("s3's hostagent process");
    let killed = Command::new("kill")
        .args(["-9", &hostagent.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let said = format!("demo: hostagent of s3 in namespace {prefix}-s3 (pid {hostagent}) exited");
    wait_for(
        "the demo to report the dead hostagent",
        Duration::from_secs(20),
        &mut demo,
        &log,
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&said)
        },
    );
    // The watch loop checks every second: still running well after that.
    std::thread::sleep(Duration::from_secs(3));
    let demo_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        demo.running(),
        "the demo ended after a hostagent died:\n{demo_log}"
    );
    assert!(
        demo_log.contains(&format!("ip netns exec {prefix}-s3 ")) && demo_log.contains(&config),
        "no command to start the hostagent again:\n{demo_log}"
    );
    assert_eq!(
        demo_log.matches(&said).count(),
        1,
        "reported once:\n{demo_log}"
    );
    assert!(!demo_log.contains("No such file"), "{demo_log}");

    let pids = demo_processes(&prefix, &dir);
    assert!(!pids.is_empty(), "no demo process found");
    let status = demo.stop().expect("demo was running");
    println!("demo exited with {status:?}");
    assert!(
        status.success(),
        "a stopped demo (SIGTERM, as `make demo-stop`) exits 0 after its teardown: {status:?}"
    );
    assert!(
        namespaces(&prefix).is_empty(),
        "namespaces left behind: {:?}",
        namespaces(&prefix)
    );
    let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
    assert!(
        !Path::new(&lab_bpf).exists(),
        "pins left behind in {lab_bpf}"
    );
    assert!(
        demo_processes(&prefix, &dir).is_empty(),
        "processes left behind"
    );
    assert_ne!(
        curl(&[&format!("{api}/healthz")]).0,
        200,
        "the API still answers after the demo stopped"
    );
}
