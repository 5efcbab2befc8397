//! Support for cross-component tests: a lab guard that builds a lab with a
//! unique prefix and always tears it down, processes started inside lab
//! namespaces that are killed when the guard drops, and lookup of the
//! project's binaries.
//!
//! Tests here run real programs (the `capybara` and `hostagent` binaries,
//! curl, wrk, ping) in real network namespaces; they need root.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Path of a binary of this workspace. System tests run the release build
/// that `make setup` produces (`CAPYBARA_BIN_DIR` overrides the directory).
pub fn bin(name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var("CAPYBARA_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let release = target.join("release").join(name);
    if release.exists() {
        return release;
    }
    target.join("debug").join(name)
}

/// A lab that exists for the guard's lifetime.
pub struct Lab {
    pub prefix: String,
    children: Vec<Child>,
}

static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Lab {
    /// Builds a lab with `servers` servers and a prefix unique to this
    /// process and call (`tag` helps when reading `ip netns`).
    pub fn up(tag: &str, servers: u32) -> Lab {
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("{tag}{}{n}", std::process::id() % 100_000);
        let out = Command::new(bin("capybara"))
            .args(["lab", "up", "--prefix", &prefix, "--servers", &servers.to_string()])
            .output()
            .expect("run capybara lab up");
        assert!(out.status.success(), "lab up failed: {}", String::from_utf8_lossy(&out.stderr));
        Lab { prefix, children: Vec::new() }
    }

    pub fn namespace(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    /// A command that runs `program` inside `node`.
    pub fn command(&self, node: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.namespace(node)]).arg(program);
        c
    }

    /// Runs a command inside `node` to completion, with a time limit.
    pub fn run(&self, node: &str, program: &str, args: &[&str], limit: Duration) -> Output {
        let mut c = self.command(node, program);
        c.args(args);
        run_with_timeout(c, limit)
    }

    /// Starts a long-running process inside `node`; it is killed when the lab
    /// guard drops (and by `lab down` in any case).
    pub fn spawn(&mut self, node: &str, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> u32 {
        let child = self
            .command(node, program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn in lab namespace");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Starts a process with its stdout captured to `log`.
    pub fn spawn_logged(
        &mut self,
        node: &str,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
        log: &std::path::Path,
    ) -> u32 {
        let f = std::fs::File::create(log).expect("create log");
        let child = self
            .command(node, program)
            .args(args)
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("spawn in lab namespace");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Waits until `cond` holds, polling every 20 ms, up to `limit`.
    pub fn wait_for(&self, what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new(bin("capybara"))
            .args(["lab", "down", "--prefix", &self.prefix])
            .output();
    }
}

/// Runs `cmd`, killing it if it outlives `limit`.
pub fn run_with_timeout(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "command timed out after {limit:?}: {cmd:?}\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Writes a hostagent configuration for lab server `j` serving an HTTP
/// service on port 80 and an echo service on port 7 of `listen_ip` (the
/// server's data address when clients connect directly, a VIP behind the
/// switch). `backend_lines` go into `[interface]` (e.g. the DPDK backend).
pub fn hostagent_config(dir: &std::path::Path, j: u32, listen_ip: &str, backend_lines: &str) -> PathBuf {
    let data = format!("198.18.2.{}", 10 + j);
    let text = format!(
        "name = \"s{j}\"\n[interface]\nname = \"eth0\"\n{backend_lines}\n[stack]\naddress = \"{data}\"\ngateway = \"198.18.1.1\"\n\
         [[service]]\nlisten = \"{listen_ip}:80\"\napp = \"http\"\n[[service]]\nlisten = \"{listen_ip}:7\"\napp = \"echo\"\n"
    );
    let path = dir.join(format!("hostagent-s{j}.toml"));
    std::fs::write(&path, text).expect("write hostagent config");
    path
}

/// A scratch directory under `test-output/` named after the test, emptied
/// first; logs written there survive a failed run for inspection.
pub fn output_dir(test: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("test-output").join(test);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("create test output dir");
    root
}
