//! Lab tests: they build real network namespaces and veth pairs with the
//! `capybara` binary and check what users rely on: reachability, the loss
//! injector's rate, idempotent `up`, clean `down` (also after a crash), and
//! one-line errors for bad input. Each test uses its own prefix, so tests run
//! in parallel and never collide with a developer's lab.

use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

fn capybara(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_capybara"))
        .args(args)
        .output()
        .expect("run capybara")
}

fn ok(args: &[&str]) -> String {
    let o = capybara(args);
    assert!(
        o.status.success(),
        "capybara {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn unique_prefix(tag: &str) -> String {
    format!("t{}{tag}", std::process::id() % 100_000)
}

fn namespaces_with(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(str::to_string)
        .collect()
}

/// Tears the lab down when the test ends, also when it fails.
struct Lab(String);
impl Drop for Lab {
    fn drop(&mut self) {
        let _ = capybara(&["lab", "down", "--prefix", &self.0]);
    }
}

fn ping(prefix: &str, node: &str, addr: &str) -> bool {
    capybara(&[
        "lab", "exec", "--prefix", prefix, node, "--", "ping", "-c", "1", "-W", "2", addr,
    ])
    .status
    .success()
}

#[test]
fn three_server_lab_is_reachable_idempotent_and_removed_cleanly() {
    let p = unique_prefix("r");
    let lab = Lab(p.clone());
    ok(&["lab", "up", "--prefix", &p, "--servers", "3"]);
    let mut expected = vec![format!("{p}-c1"), format!("{p}-s1"), format!("{p}-s2")];
    expected.extend([format!("{p}-s3"), format!("{p}-sw")]);
    let mut got = namespaces_with(&p);
    got.sort();
    assert_eq!(got, expected);

    // Every node reaches the switch; the switch reaches every server's
    // management address; the client reaches servers through the switch.
    assert!(
        ping(&p, "c1", "198.18.0.1"),
        "client cannot reach the switch"
    );
    for j in 1..=3 {
        let s = format!("s{j}");
        let mgmt = format!("198.18.1.{}", 10 + j);
        assert!(ping(&p, &s, "198.18.1.1"), "{s} cannot reach the switch");
        assert!(ping(&p, "sw", &mgmt), "switch cannot reach {s}");
        assert!(
            ping(&p, "c1", &mgmt),
            "client cannot reach {s} through the switch"
        );
    }
    // No namespace has a route off the lab range.
    for ns in &got {
        let routes = Command::new("ip")
            .args(["-n", ns, "-4", "route"])
            .output()
            .unwrap();
        let routes = String::from_utf8_lossy(&routes.stdout);
        assert!(
            !routes.contains("default"),
            "{ns} has a default route: {routes}"
        );
    }

    // `up` again changes nothing and succeeds.
    let before = ok(&["lab", "status", "--prefix", &p]);
    ok(&["lab", "up", "--prefix", &p, "--servers", "3"]);
    assert_eq!(ok(&["lab", "status", "--prefix", &p]), before);

    // A fault injector is attached, so `down` must remove an eBPF program.
    ok(&["lab", "fault", "--prefix", &p, "s1", "--drop", "1%"]);
    let filters = Command::new("tc")
        .args([
            "-n",
            &format!("{p}-s1"),
            "filter",
            "show",
            "dev",
            "eth0",
            "ingress",
        ])
        .output()
        .unwrap();
    let filters = String::from_utf8_lossy(&filters.stdout).into_owned();
    let prog_id = filters
        .split_whitespace()
        .skip_while(|w| *w != "id")
        .nth(1)
        .expect("fault injector program id in tc filter output")
        .to_string();

    ok(&["lab", "down", "--prefix", &p]);
    assert!(namespaces_with(&p).is_empty(), "namespaces left behind");
    let links = Command::new("ip").args(["-br", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(
        !links
            .lines()
            .any(|l| l.starts_with("cl") || l.starts_with("sv")),
        "{links}"
    );
    // The kernel frees a detached program after an RCU grace period.
    let loaded = || {
        Command::new("bpftool")
            .args(["prog", "show", "id", &prog_id])
            .output()
            .unwrap()
            .status
            .success()
    };
    for _ in 0..50 {
        if !loaded() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!loaded(), "eBPF program {prog_id} still loaded after down");
    assert!(!std::path::Path::new(&format!("/sys/fs/bpf/capybara-lab-{p}")).exists());
    drop(lab);
}

#[test]
fn loss_injector_drops_about_ten_percent_of_pings() {
    let p = unique_prefix("l");
    let _lab = Lab(p.clone());
    ok(&["lab", "up", "--prefix", &p, "--servers", "1"]);
    ok(&["lab", "fault", "--prefix", &p, "c1", "--drop", "0.1"]);
    let out = capybara(&[
        "lab",
        "exec",
        "--prefix",
        &p,
        "c1",
        "--",
        "ping",
        "-q",
        "-c",
        "10000",
        "-i",
        "0.0002",
        "-W",
        "1",
        "198.18.1.11",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .expect("ping summary");
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (sent, received) = (nums[0], nums[1]);
    assert_eq!(sent, 10_000);
    let loss = 1.0 - received as f64 / sent as f64;
    assert!(
        (0.05..=0.15).contains(&loss),
        "loss {loss} out of [5%, 15%]: {line}"
    );
    let stats = ok(&["lab", "fault", "--prefix", &p, "c1", "--stats"]);
    assert!(stats.contains("dropped="), "{stats}");
    ok(&["lab", "fault", "--prefix", &p, "c1", "--clear"]);
    assert!(ping(&p, "c1", "198.18.1.11"));
}

#[test]
fn down_cleans_up_after_a_crashed_up() {
    let p = unique_prefix("k");
    let _lab = Lab(p.clone());
    // Its own process group, so that the crash takes the `ip` commands it
    // runs with it (an orphaned `ip netns add` finishing after `lab down`
    // would be a namespace nobody could have cleaned up yet).
    let mut child = Command::new(env!("CARGO_BIN_EXE_capybara"))
        .args(["lab", "up", "--prefix", &p, "--servers", "30"])
        .process_group(0)
        .spawn()
        .unwrap();
    // Kill it once it has created something, well before it can finish.
    for _ in 0..200 {
        if !namespaces_with(&p).is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.wait();
    ok(&["lab", "down", "--prefix", &p]);
    assert!(namespaces_with(&p).is_empty());
}

fn assert_one_line_error(args: &[&str], needle: &str) {
    let o = capybara(args);
    assert_eq!(
        o.status.code(),
        Some(2),
        "capybara {args:?} should fail with status 2"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(
        err.contains(needle),
        "error {err:?} does not name {needle:?}"
    );
}

#[test]
fn bad_flags_and_configs_give_one_clear_line_and_build_nothing() {
    let p = unique_prefix("e");
    assert_one_line_error(
        &["lab", "up", "--prefix", &p, "--servers", "abc"],
        "\"abc\"",
    );
    assert_one_line_error(&["lab", "up", "--prefix", &p, "--servers", "0"], "\"0\"");
    assert_one_line_error(
        &["lab", "up", "--prefix", &p, "--clients", "9999"],
        "\"9999\"",
    );
    assert_one_line_error(&["lab", "up", "--prefix", "Bad-Prefix"], "\"Bad-Prefix\"");
    assert_one_line_error(
        &["lab", "exec", "--prefix", &p, "x9", "--", "true"],
        "\"x9\"",
    );
    assert_one_line_error(
        &["lab", "fault", "--prefix", &p, "c1", "--drop", "2"],
        "\"2\"",
    );

    let dir = std::env::temp_dir().join(format!("capybara-labcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("lab.toml");
    std::fs::write(&cfg, format!("prefix = \"{p}\"\nsevrers = 3\n")).unwrap();
    assert_one_line_error(&["lab", "up", "--config", cfg.to_str().unwrap()], "sevrers");
    std::fs::write(&cfg, format!("prefix = \"{p}\"\nservers = \"three\"\n")).unwrap();
    assert_one_line_error(&["lab", "up", "--config", cfg.to_str().unwrap()], "servers");
    std::fs::write(&cfg, format!("prefix = \"{p}\"\nservers = 0\n")).unwrap();
    assert_one_line_error(&["lab", "up", "--config", cfg.to_str().unwrap()], "\"0\"");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        namespaces_with(&p).is_empty(),
        "a failed up left namespaces behind"
    );
}
