//! `make demo`'s promise for a dying application (root; the binaries next
//! to this test's `capybara`, or `CAPYBARA_BIN_DIR`): a `kill -9` of a
//! server's nginx (docs/OPERATIONS.md, "The appliance demo") takes the
//! application down, so the hostagent's health check declares it DOWN, the
//! demo names the process and prints a command that starts it again, and
//! that command works (the hostagent declares it UP). Before, the demo ran
//! nginx with a master process: SIGKILL of the pid the demo watches left
//! the worker serving (no DOWN) and holding the port, so the printed
//! command failed with `bind() ... Address already in use`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn bin_dir() -> PathBuf {
    std::env::var_os("CAPYBARA_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_BIN_EXE_capybara"))
                .parent()
                .expect("the directory of capybara")
                .to_path_buf()
        })
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The demo script; SIGTERM (what `make demo-stop` sends) and its own
/// teardown on drop, then `lab down` in case it could not.
struct Demo {
    child: Child,
    prefix: String,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if self.child.try_wait().ok().flatten().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new(bin_dir().join("capybara"))
            .args(["lab", "down", "--prefix", &self.prefix])
            .output();
    }
}

fn wait_for(what: &str, limit: Duration, demo: &mut Demo, log: &Path, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            demo.child.try_wait().expect("wait").is_none(),
            "the demo exited while waiting for {what}:\n{}",
            read(log)
        );
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}:\n{}",
            read(log)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether something answers HTTP on the demo application's port of `ns`.
fn app_answers(ns: &str) -> bool {
    Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "curl",
            "-sf",
            "-m",
            "1",
            "-o",
            "/dev/null",
        ])
        .arg("http://127.0.0.1:8081/")
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_killed_nginx_goes_down_and_the_printed_command_brings_it_back() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (network namespaces, eBPF)");
        return;
    }
    for b in ["capybara", "hostagent", "capybara-loadgen"] {
        assert!(
            bin_dir().join(b).is_file(),
            "{b} missing in {} (build the release binaries, or set CAPYBARA_BIN_DIR)",
            bin_dir().display()
        );
    }
    let tag = std::process::id() % 100_000;
    let prefix = format!("t{tag}nd");
    let base = std::env::temp_dir().join(format!("capybara-demo-app-{tag}"));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let (dir, out, log) = (base.join("state"), base.join("out"), base.join("demo.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new("bash")
        .arg("scripts/demo.sh")
        .current_dir(root())
        .env("CAPYBARA_BIN_DIR", bin_dir())
        .env("CAPYBARA_LAB_PREFIX", &prefix)
        .env("CAPYBARA_DEMO_PORT", free_port().to_string())
        .env("CAPYBARA_DEMO_DIR", &dir)
        .env("CAPYBARA_DEMO_OUT", &out)
        .env("CAPYBARA_DEMO_SECONDS", "150")
        .env("CAPYBARA_DEMO_RATE", "200")
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("start scripts/demo.sh");
    let mut demo = Demo {
        child,
        prefix: prefix.clone(),
    };
    wait_for(
        "the demo",
        Duration::from_secs(120),
        &mut demo,
        &log,
        || read(&log).contains("Capybara demo is up."),
    );

    let ns = format!("{prefix}-s1");
    let agent_log = dir.join("hostagent-s1.log");
    let pid_file = dir.join("nginx-s1").join("nginx.pid");
    let pid = read(&pid_file).trim().to_string();
    assert!(
        !pid.is_empty() && app_answers(&ns),
        "nginx of s1 runs (pid {pid:?})"
    );
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());

    // The application is gone: nothing answers on its port, and the
    // hostagent's health check says so.
    wait_for(
        "s1's application to stop answering",
        Duration::from_secs(5),
        &mut demo,
        &log,
        || !app_answers(&ns),
    );
    wait_for(
        "s1's hostagent to declare its application DOWN",
        Duration::from_secs(10),
        &mut demo,
        &log,
        || read(&agent_log).contains("service 198.18.100.1:80 DOWN"),
    );
    // The demo goes on, names the process and prints how to start it again.
    let named = format!("nginx of s1 in namespace {ns} (pid {pid}) exited");
    wait_for(
        "the demo to name the dead nginx",
        Duration::from_secs(10),
        &mut demo,
        &log,
        || read(&log).contains(&named),
    );
    let text = read(&log);
    let after = &text[text.find(&named).unwrap()..];
    let cmd = after
        .lines()
        .nth(1)
        .map(str::trim)
        .filter(|l| l.starts_with("ip netns exec"))
        .unwrap_or_else(|| panic!("no restart command after {named:?}:\n{text}"))
        .to_string();

    // The printed command starts it again: the port is free, so nginx binds
    // it and the hostagent's probes bring the service back UP.
    let restarted = Command::new("bash")
        .args(["-c", &cmd])
        .status()
        .expect("run the printed command");
    assert!(restarted.success(), "`{cmd}` failed");
    wait_for(
        "the restarted nginx to answer",
        Duration::from_secs(10),
        &mut demo,
        &log,
        || app_answers(&ns),
    );
    wait_for(
        "s1's hostagent to declare its application UP",
        Duration::from_secs(10),
        &mut demo,
        &log,
        || read(&agent_log).contains("service 198.18.100.1:80 UP"),
    );
    let nginx_log = read(&dir.join("nginx-s1.log"));
    assert!(
        !nginx_log.contains("Address already in use"),
        "the restarted nginx could not bind: {nginx_log}"
    );

    drop(demo);
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains(&format!("{prefix}-")),
        "namespaces of {prefix} left behind"
    );
    let _ = std::fs::remove_dir_all(&base);
}
