//! `make demo` end to end (root; release binaries, or `CAPYBARA_BIN_DIR`):
//! runs `scripts/demo.sh` with `CAPYBARA_DEMO_SECONDS`, checks the API and
//! the dashboard from the host at http://127.0.0.1:8080, migrates one live
//! connection through the API (switchd-backed control plane), then stops
//! the demo and checks that nothing of the lab remains.

use capybara_systests::{bin, output_dir};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const API: &str = "http://127.0.0.1:8080";
const PREFIX: &str = "demo";

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

fn demo_namespaces() -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{PREFIX}-")))
        .map(str::to_string)
        .collect()
}

/// The running demo script; stopped (SIGTERM, then its own teardown) on drop.
struct Demo {
    child: Option<Child>,
}

impl Demo {
    fn start(log: &Path, seconds: u64) -> Demo {
        let f = std::fs::File::create(log).expect("create demo log");
        let mut c = Command::new("bash");
        c.arg("scripts/demo.sh")
            .current_dir(root())
            .env("CAPYBARA_DEMO_SECONDS", seconds.to_string())
            .env("CAPYBARA_LAB_PREFIX", PREFIX)
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        // The script looks for binaries in CAPYBARA_BIN_DIR first, then
        // target/release: point it where this test found them.
        if std::env::var_os("CAPYBARA_BIN_DIR").is_none() {
            if let Some(dir) = bin("capybara-api").parent() {
                c.env("CAPYBARA_BIN_DIR", dir);
            }
        }
        Demo {
            child: Some(c.spawn().expect("start scripts/demo.sh")),
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
                .args(["lab", "down", "--prefix", PREFIX])
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

/// First `"id":"..."` string value in a JSON text (connection ids are
/// `IP:PORT-VIP:PORT`).
fn first_connection_id(json: &str) -> Option<String> {
    let rest = &json[json.find("\"id\":\"")? + 6..];
    Some(rest[..rest.find('"')?].to_string())
}

fn migrations_seen(demo_dir: &Path) -> (usize, u64) {
    let mut logged = 0;
    for j in 1..=3 {
        let log = std::fs::read_to_string(demo_dir.join(format!("hostagent-s{j}.log")))
            .unwrap_or_default();
        logged += log.lines().filter(|l| l.contains(" migrated to ")).count();
    }
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &format!("{PREFIX}-sw"),
            "curl",
            "-s",
            "-m",
            "2",
            "http://127.0.0.1:9102/metrics",
        ])
        .output();
    let acks = out
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("reason=\"fwd_prepare_ack\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    (logged, acks)
}

#[test]
fn demo_serves_the_api_and_migrates_a_connection_then_tears_down() {
    let out = output_dir("demo_test");
    let log = out.join("demo.log");
    let seconds = std::env::var("CAPYBARA_DEMO_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let mut demo = Demo::start(&log, seconds);

    wait_for(
        "the API's /healthz on the host",
        Duration::from_secs(180),
        &mut demo,
        &log,
        || curl(&[&format!("{API}/healthz")]).0 == 200,
    );
    // The banner comes right after the API answers from the host.
    wait_for(
        "the demo's banner",
        Duration::from_secs(60),
        &mut demo,
        &log,
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("Press Ctrl-C")
        },
    );
    let token = std::fs::read_to_string(root().join("test-output/demo/admin-token"))
        .expect("admin token file");
    let auth = format!("Authorization: Bearer {}", token.trim());
    let demo_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        demo_log.contains("http://127.0.0.1:8080"),
        "no dashboard URL printed:\n{demo_log}"
    );
    assert!(
        demo_log.contains(token.trim()),
        "the admin token was not printed:\n{demo_log}"
    );

    let (code, health) = curl(&[&format!("{API}/healthz")]);
    assert_eq!(code, 200);
    assert!(health.contains("\"control_plane\":\"switchd\""), "{health}");

    let (code, servers) = curl(&["-H", &auth, &format!("{API}/v1/servers")]);
    assert_eq!(code, 200, "{servers}");
    assert_eq!(servers.matches("\"mgmt_addr\"").count(), 3, "{servers}");
    assert!(servers.contains("\"data_source\":\"switchd\""), "{servers}");

    let (code, index) = curl(&[&format!("{API}/")]);
    assert_eq!(code, 200);
    let expected = std::fs::read_to_string(root().join("web-ui/dist/index.html"))
        .expect("web-ui/dist/index.html");
    assert_eq!(
        index.trim(),
        expected.trim(),
        "/ is not the dashboard's index.html"
    );

    // A live connection of the client load, migrated through the API.
    let mut conn = None;
    wait_for(
        "a connection listed by the API",
        Duration::from_secs(60),
        &mut demo,
        &log,
        || {
            let (code, body) = curl(&["-H", &auth, &format!("{API}/v1/connections?limit=5")]);
            conn = if code == 200 {
                first_connection_id(&body)
            } else {
                None
            };
            conn.is_some()
        },
    );
    let conn = conn.unwrap();
    let demo_dir = root().join("target/demo");
    let before = migrations_seen(&demo_dir);
    let (code, body) = curl(&[
        "-X",
        "POST",
        "-H",
        &auth,
        &format!("{API}/v1/connections/{conn}/migrate"),
    ]);
    assert_eq!(code, 202, "migrate {conn}: {body}");
    assert!(body.contains("\"trigger\":\"manual\""), "{body}");
    let mut after = before;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        after = migrations_seen(&demo_dir);
        if after.0 > before.0 || after.1 > before.1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(
        after.0 > before.0 || after.1 > before.1,
        "no migration of {conn} seen (hostagent ' migrated to ' lines {before:?} -> {after:?} [lines, fwd_prepare_ack])"
    );
    let (_, migrations) = curl(&["-H", &auth, &format!("{API}/v1/migrations")]);
    println!(
        "migrated {conn}: hostagent log lines {} -> {}, fwd_prepare_ack {} -> {}",
        before.0, after.0, before.1, after.1
    );
    println!("GET /v1/migrations: {migrations}");

    let status = demo.stop().expect("demo was running");
    println!("demo exited with {status:?}");
    assert!(
        demo_namespaces().is_empty(),
        "namespaces left behind: {:?}",
        demo_namespaces()
    );
    assert_ne!(
        curl(&[&format!("{API}/healthz")]).0,
        200,
        "the API still answers after the demo stopped"
    );
    let _ = std::fs::copy(&log, out.join("demo.log.final"));
}
