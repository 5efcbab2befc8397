//! `make bench-store`: batched flow writes per second and batch latency p99
//! for each backend (a temp SQLite file; a 1-member etcd started on
//! loopback by the test harness).
//!
//! Usage: cargo run --release -p capybara-store --features testing --example bench_store [-- --quick]
//!
//! Last line: `RESULT sqlite_flow_writes_per_s=... sqlite_batch_p99_ms=... etcd_flow_writes_per_s=... etcd_batch_p99_ms=...`

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::testing::EtcdCluster;
use capybara_store::*;

const BATCH: usize = 1000;

fn flow(i: u32) -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::from(0x0a00_0000 + (i >> 15)),
        client_port: 1024 + (i & 0x7fff) as u16,
        service_ip: Ipv4Addr::new(192, 168, 0, 1),
        service_port: 443,
    }
}

/// A packet-path-like mix: 3 new flows (put) for every migration (put of an
/// existing flow to another server) and every closed flow (delete).
fn batch(b: u32) -> Vec<FlowOp> {
    let base = b * BATCH as u32;
    (0..BATCH as u32)
        .map(|i| {
            let n = base + i;
            match i % 5 {
                3 if n > 10_000 => FlowOp::Put {
                    key: flow(n - 10_000),
                    server: ServerId(n % 13),
                },
                4 if n > 20_000 => FlowOp::Delete {
                    key: flow(n - 20_000),
                },
                _ => FlowOp::Put {
                    key: flow(n),
                    server: ServerId(n % 7),
                },
            }
        })
        .collect()
}

struct Outcome {
    writes_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Writes `batches` batches with `lanes` concurrent writers (each writer owns
/// a disjoint set of batches, as `FlowWriter` lanes sharded by flow would).
async fn run(store: Arc<dyn Store>, batches: u32, lanes: u32) -> Outcome {
    // Warm-up (connection, statement cache, etcd first txn).
    store
        .apply_flows(&batch(batches + 100))
        .await
        .expect("warm-up");
    let start = Instant::now();
    let mut tasks = Vec::new();
    for lane in 0..lanes {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut b = lane;
            while b < batches {
                let ops = batch(b);
                let t = Instant::now();
                store.apply_flows(&ops).await.expect("apply_flows");
                lat.push(t.elapsed());
                b += lanes;
            }
            lat
        }));
    }
    let mut lat: Vec<Duration> = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("lane"));
    }
    let elapsed = start.elapsed();
    lat.sort();
    let pct =
        |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1e3;
    Outcome {
        writes_per_s: f64::from(batches) * BATCH as f64 / elapsed.as_secs_f64(),
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (sqlite_batches, etcd_batches) = if quick { (50, 30) } else { (500, 300) };

    let dir = tempfile::Builder::new()
        .prefix("capybara-bench-")
        .tempdir()
        .expect("temp dir");
    let sqlite: Arc<dyn Store> = Arc::new(
        SqliteStore::open(SqliteConfig::at(dir.path().join("bench.db")))
            .await
            .expect("open sqlite"),
    );
    let s = run(sqlite.clone(), sqlite_batches, 1).await;
    println!(
        "sqlite: {} batches of {BATCH}: {:.0} flow writes/s, batch p50 {:.2} ms, p99 {:.2} ms",
        sqlite_batches, s.writes_per_s, s.p50_ms, s.p99_ms
    );

    // The same through FlowWriter (queue, batching, metrics), end to end.
    let writer = FlowWriter::spawn(sqlite.clone(), FlowWriterConfig::default());
    let n = if quick { 50_000u32 } else { 200_000 };
    let t = Instant::now();
    let mut refused = 0u64;
    for i in 0..n {
        if writer
            .try_push(FlowOp::Put {
                key: flow(5_000_000 + i),
                server: ServerId(1),
            })
            .is_err()
        {
            refused += 1;
        }
    }
    writer.flush(Duration::from_secs(60)).await.expect("flush");
    let sw = f64::from(n) / t.elapsed().as_secs_f64();
    println!(
        "sqlite via FlowWriter: {sw:.0} flow writes/s ({refused} refused), metrics {:?}",
        writer.metrics()
    );
    writer.close(Duration::from_secs(5)).await.expect("close");

    let cluster = EtcdCluster::start(1).expect("start etcd");
    let config = EtcdConfig {
        max_txn_ops: BATCH,
        ..cluster.store_config()
    };
    let etcd: Arc<dyn Store> = Arc::new(EtcdStore::connect(config).await.expect("connect etcd"));
    // One lane is what FlowWriter does (one flusher, batches in order).
    let e = run(etcd.clone(), etcd_batches, 1).await;
    println!(
        "etcd, 1 lane: {etcd_batches} batches of {BATCH}: {:.0} flow writes/s, batch p50 {:.2} ms, p99 {:.2} ms",
        e.writes_per_s, e.p50_ms, e.p99_ms
    );
    let e4 = run(etcd.clone(), etcd_batches / 3, 4).await;
    println!(
        "etcd, 4 concurrent lanes (for comparison): {:.0} flow writes/s, batch p50 {:.2} ms, p99 {:.2} ms",
        e4.writes_per_s, e4.p50_ms, e4.p99_ms
    );
    drop(cluster);
    println!(
        "RESULT sqlite_flow_writes_per_s={:.0} sqlite_batch_p99_ms={:.2} etcd_flow_writes_per_s={:.0} etcd_batch_p99_ms={:.2}",
        s.writes_per_s, s.p99_ms, e.writes_per_s, e.p99_ms
    );
}
