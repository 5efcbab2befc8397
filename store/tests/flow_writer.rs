//! The flow writer under store outages: it retries with backoff, reports its
//! backlog, last error and overflow, never blocks `try_push`, and recovers
//! by itself.

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::testing::EtcdCluster;
use capybara_store::*;

fn flow(i: u32) -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::from(i),
        client_port: 1,
        service_ip: Ipv4Addr::new(10, 9, 9, 9),
        service_port: 80,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_backlog_overflow_and_recovery() {
    let mut cluster = EtcdCluster::start(1).unwrap();
    let cfg = EtcdConfig {
        request_timeout_ms: 500,
        connect_timeout_ms: 300,
        ..cluster.store_config()
    };
    let store: Arc<dyn Store> = Arc::new(EtcdStore::connect(cfg).await.unwrap());
    let writer = FlowWriter::spawn(
        store.clone(),
        FlowWriterConfig {
            capacity: 1000,
            max_batch: 100,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(200),
            flush_timeout: Duration::from_millis(800),
            ..Default::default()
        },
    );
    cluster.stop_member(0);
    // Fill the queue while the store is down; try_push must never block.
    let mut accepted = 0u32;
    let mut refused = 0u32;
    for i in 0..2000u32 {
        let t = Instant::now();
        match writer.try_push(FlowOp::Put {
            key: flow(i),
            server: ServerId(1),
        }) {
            Ok(()) => accepted += 1,
            Err(o) => {
                assert_eq!(o.reason, OverflowReason::QueueFull);
                refused += 1;
            }
        }
        assert!(
            t.elapsed() < Duration::from_millis(50),
            "try_push blocked for {:?}",
            t.elapsed()
        );
    }
    assert!(refused > 0, "overflow is reported");
    let m = support::eventually(
        Duration::from_secs(10),
        "writer reports the outage",
        || async {
            let m = writer.metrics();
            (m.retrying && m.flush_errors_total >= 2 && m.last_error.is_some()).then_some(m)
        },
    )
    .await;
    assert_eq!(m.overflow_total, u64::from(refused));
    assert_eq!(m.backlog, u64::from(accepted));
    assert!(m.lag > Duration::ZERO);
    let prom = m.to_prometheus();
    assert!(
        prom.contains(&format!(
            "capybara_store_flow_writer_overflow_total {refused}"
        )),
        "{prom}"
    );
    assert!(
        prom.contains("capybara_store_flow_writer_retrying 1"),
        "{prom}"
    );

    cluster.restart_member(0).unwrap();
    writer
        .flush(Duration::from_secs(30))
        .await
        .expect("recovers by itself");
    let m = writer.metrics();
    assert_eq!(m.backlog, 0);
    assert!(!m.retrying);
    assert_eq!(store.count_flows().await.unwrap(), u64::from(accepted));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_locked_by_another_process_then_released() {
    let dir = tempfile::Builder::new()
        .prefix("capybara-writer-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("s.db");
    let cfg = SqliteConfig {
        busy_timeout_ms: 50,
        ..SqliteConfig::at(&path)
    };
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(cfg).await.unwrap());
    // Another "process" holds the write lock.
    let locker = rusqlite::Connection::open(&path).unwrap();
    locker.execute_batch("BEGIN EXCLUSIVE;").unwrap();
    let writer = FlowWriter::spawn(
        store.clone(),
        FlowWriterConfig {
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
            ..Default::default()
        },
    );
    for i in 0..500 {
        writer
            .try_push(FlowOp::Put {
                key: flow(i),
                server: ServerId(2),
            })
            .unwrap();
    }
    let m = support::eventually(
        Duration::from_secs(10),
        "writer reports the lock",
        || async {
            let m = writer.metrics();
            (m.retrying
                && m.last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("locked")))
            .then_some(m)
        },
    )
    .await;
    assert_eq!(m.backlog, 500);
    locker.execute_batch("COMMIT;").unwrap();
    writer.flush(Duration::from_secs(10)).await.unwrap();
    assert_eq!(store.count_flows().await.unwrap(), 500);
    writer.close(Duration::from_secs(1)).await.unwrap();
}
