//! What the application-health lab tests share (`health_lab.rs` for HTTP
//! behind nginx, `health_resp_lab.rs` for RESP behind redis-server): the
//! hostagent config with one health-checked sidecar service, a Python
//! client process driven line by line, and the metrics they read.

#![allow(dead_code)] // each test binary uses its own subset

use capybara_systests::{bin, disable_policies, metric_sum, stdout_lines, Lab};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A hostagent config for server `j`: one sidecar service on `listen`
/// relaying to `backend` with `protocol`, health checks every 200 ms
/// (fall 2, rise 2), policies off (only the health check moves
/// connections).
pub fn hostagent_config(
    dir: &Path,
    j: u32,
    key: &Path,
    listen: &str,
    backend: &str,
    protocol: &str,
) -> PathBuf {
    let t = format!(
        "name = \"s{j}\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.{}\"\ngateway = \"198.18.1.1\"\n\
         [[service]]\nlisten = \"{listen}\"\napp = \"sidecar\"\nbackend = \"{backend}\"\nprotocol = \"{protocol}\"\n\
         [migration]\nkey_file = \"{}\"\nswitch = \"198.18.1.1\"\n\
         [control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {j}\nmanagement = \"198.18.1.{}\"\n\
         [health]\ninterval_ms = 200\ntimeout_ms = 200\nfall = 2\nrise = 2\n",
        10 + j,
        key.display(),
        10 + j
    );
    let path = dir.join(format!("hostagent-s{j}.toml"));
    std::fs::write(&path, t).expect("write hostagent config");
    disable_policies(&path);
    path
}

/// A client process in namespace `c1` (`python3 -c SCRIPT ARGS`) that
/// answers each line written to it with output lines ending in `done`;
/// killed when dropped.
pub struct LineClient {
    child: Child,
    rx: std::sync::mpsc::Receiver<String>,
    what: &'static str,
}

impl LineClient {
    pub fn start(lab: &Lab, script: &str, args: &[&str], what: &'static str) -> LineClient {
        let mut child = lab
            .command("c1", "python3")
            .args(["-c", script])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start the {what}: {e}"));
        let rx = stdout_lines(child.stdout.take().unwrap());
        LineClient { child, rx, what }
    }

    /// Writes `line`, returns the output lines up to `done` (at most 60 s).
    pub fn ask(&mut self, line: &str) -> Vec<String> {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .unwrap_or_else(|e| panic!("signal the {}: {e}", self.what));
        let mut lines = Vec::new();
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) if l == "done" => break,
                Ok(l) => lines.push(l),
                Err(e) => panic!("{}: no round within 60 s ({e}): {lines:?}", self.what),
            }
        }
        lines
    }
}

impl Drop for LineClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `python3 -c SCRIPT ARGS` in `c1` to its end: its output lines, or
/// `None` if it outlived 60 s.
pub fn run_client(lab: &Lab, script: &str, args: &[&str]) -> Option<Vec<String>> {
    let mut all = vec!["-c", script];
    all.extend_from_slice(args);
    let out = lab.try_run("c1", "python3", &all, Duration::from_secs(60))?;
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect(),
    )
}

/// switchd's `/metrics` through its `--dump` (run in the switch namespace).
pub fn switchd_metrics(lab: &Lab, sw: &Path) -> String {
    lab.try_run(
        "sw",
        bin("switchd").to_str().unwrap(),
        &["--config", sw.to_str().unwrap(), "--dump", "/metrics"],
        Duration::from_secs(10),
    )
    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    .unwrap_or_default()
}

/// Whether switchd's metrics say server `j`'s application of `service`
/// (VIP:port) is `up`.
pub fn switchd_backend_up(lab: &Lab, sw: &Path, j: u32, service: &str, up: bool) -> bool {
    switchd_metrics(lab, sw).contains(&format!(
        "capybara_switchd_backend_up{{server=\"{j}\",service=\"{service}\"}} {}",
        u8::from(up)
    ))
}

/// Server `j`'s own view of its application (`capybara_backend_up`).
pub fn backend_up(lab: &Lab, j: u32) -> Option<f64> {
    metric_sum(&lab.server_metrics(j), "capybara_backend_up", "")
}

/// Connections server `j` migrated out so far.
pub fn migrated_out(lab: &Lab, j: u32) -> f64 {
    metric_sum(
        &lab.server_metrics(j),
        "capybara_tcpmig_events_total",
        "event=\"migrated_out\"",
    )
    .unwrap_or(-1.0)
}
