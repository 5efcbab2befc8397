//! Test support (feature `testing`): real etcd processes on loopback.
//!
//! `EtcdCluster::start(n)` spawns an `n`-member cluster of `/usr/bin/etcd`
//! (or `$ETCD_BIN`) on free 127.0.0.1 ports with data dirs in a temp dir.
//! Dropping the cluster kills every member and deletes the data, also when a
//! test panics (drop runs during unwinding). Members also get
//! `PR_SET_PDEATHSIG`, so they die with the thread that started them even if
//! the test process is killed: start and restart members from the test's
//! own thread (the body of a `#[tokio::test]` is fine), not from a pooled
//! blocking thread.
//!
//! Every loop here is bounded in attempts and time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::etcd::EtcdConfig;

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("etcd harness: {0}")]
    Io(#[from] std::io::Error),
    #[error("etcd harness: cannot run {bin}: {reason}")]
    Spawn { bin: String, reason: String },
    #[error("etcd harness: member {member} not healthy after {waited:?}; log tail:\n{log_tail}")]
    NotHealthy {
        member: String,
        waited: Duration,
        log_tail: String,
    },
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A real etcd cluster for tests. Kills its members and deletes their data on drop.
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    token: String,
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A name unique across threads and processes (pid, counter, clock).
pub fn unique_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

fn etcd_bin() -> String {
    std::env::var("ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into())
}

/// Distinct free loopback ports (held open together so they differ).
fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

fn log_tail(path: &PathBuf) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// `GET /health` on a member's client port.
fn healthy(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = Vec::new();
    let _ = s.take(4096).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).contains("\"health\":\"true\"")
}

impl EtcdCluster {
    /// Starts `size` members and waits until each reports healthy.
    /// Retries with fresh ports if a port was taken meanwhile.
    pub fn start(size: usize) -> Result<Self, HarnessError> {
        let mut last = None;
        for _attempt in 0..3 {
            match Self::try_start(size.max(1)) {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| HarnessError::Spawn {
            bin: etcd_bin(),
            reason: "no attempt made".into(),
        }))
    }

    fn try_start(size: usize) -> Result<Self, HarnessError> {
        let dir = tempfile::Builder::new()
            .prefix("capybara-etcd-")
            .tempdir()?;
        let ports = free_ports(size * 2)?;
        let members: Vec<Member> = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                data_dir: dir.path().join(format!("m{i}.data")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let mut cluster = EtcdCluster {
            dir,
            members,
            token: unique_name("capybara-test"),
        };
        for i in 0..size {
            cluster.spawn_member(i, "new")?;
        }
        for i in 0..size {
            cluster.wait_healthy(i, Duration::from_secs(20))?;
        }
        Ok(cluster)
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn_member(&mut self, i: usize, state: &str) -> Result<(), HarnessError> {
        let initial_cluster = self.initial_cluster();
        let token = self.token.clone();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)?;
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let mut cmd = Command::new(etcd_bin());
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(initial_cluster)
            .arg("--initial-cluster-token")
            .arg(token)
            .arg("--initial-cluster-state")
            .arg(state)
            // Fast elections keep failover tests short; minimum lease TTL = 1 s.
            .arg("--heartbeat-interval")
            .arg("50")
            .arg("--election-timeout")
            .arg("500")
            .arg("--max-txn-ops")
            .arg("4096")
            .arg("--max-request-bytes")
            .arg("10485760")
            .arg("--quota-backend-bytes")
            .arg("4294967296")
            .arg("--logger")
            .arg("zap")
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe and touches no Rust state.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| HarnessError::Spawn {
            bin: etcd_bin(),
            reason: e.to_string(),
        })?;
        m.child = Some(child);
        Ok(())
    }

    /// Waits until member `i` answers `/health` with true.
    pub fn wait_healthy(&mut self, i: usize, timeout: Duration) -> Result<(), HarnessError> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            let m = &mut self.members[i];
            if let Some(child) = m.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(HarnessError::NotHealthy {
                        member: m.name.clone(),
                        waited: start.elapsed(),
                        log_tail: format!("exited with {status}\n{}", log_tail(&m.log)),
                    });
                }
            }
            if healthy(m.client_port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let m = &self.members[i];
        Err(HarnessError::NotHealthy {
            member: m.name.clone(),
            waited: start.elapsed(),
            log_tail: log_tail(&m.log),
        })
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Client URL of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// A store config on this cluster with a fresh key prefix, so tests
    /// sharing a cluster never see each other's keys.
    pub fn store_config(&self) -> EtcdConfig {
        EtcdConfig {
            endpoints: self.endpoints(),
            prefix: format!("/{}", unique_name("t")),
            max_txn_ops: 4096,
            connect_timeout_ms: 1_000,
            request_timeout_ms: 3_000,
        }
    }

    /// Kills member `i` (SIGKILL, like a crash) and waits for it to exit.
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Restarts a stopped member with its data dir and waits for health.
    pub fn restart_member(&mut self, i: usize) -> Result<(), HarnessError> {
        self.stop_member(i);
        self.spawn_member(i, "existing")?;
        self.wait_healthy(i, Duration::from_secs(20))
    }

    pub fn data_dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
        // `dir` (TempDir) removes the data dirs after this.
    }
}
