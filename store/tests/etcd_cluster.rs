//! A 3-member etcd cluster loses its raft leader during a stream of flow
//! writes: nothing acknowledged is lost and the writer recovers by itself.

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::testing::EtcdCluster;
use capybara_store::*;

fn flow(i: u32) -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::from(0x0a00_0000 + i),
        client_port: 40_000,
        service_ip: Ipv4Addr::new(192, 168, 0, 1),
        service_port: 80,
    }
}

/// Index of the member that is the raft leader, asked of each live member.
async fn leader_index(cluster: &EtcdCluster) -> usize {
    let eps = cluster.endpoints();
    for _ in 0..100 {
        for (i, ep) in eps.iter().enumerate() {
            let Ok(mut c) = etcd_client::Client::connect([ep], None).await else {
                continue;
            };
            if let Ok(st) = c.status().await {
                if st.header().map(|h| h.member_id()) == Some(st.leader()) {
                    return i;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no etcd leader found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_minority_member_loses_nothing_acknowledged() {
    let mut cluster = EtcdCluster::start(3).expect("start 3-member etcd");
    let config = EtcdConfig {
        request_timeout_ms: 2_000,
        ..cluster.store_config()
    };
    let store: Arc<dyn Store> = Arc::new(EtcdStore::connect(config.clone()).await.unwrap());
    let writer = FlowWriter::spawn(
        store.clone(),
        FlowWriterConfig {
            max_batch: 1000,
            initial_backoff: Duration::from_millis(20),
            flush_timeout: Duration::from_secs(3),
            ..Default::default()
        },
    );

    let n = 30_000u32;
    let killed = leader_index(&cluster).await;
    let mut acked_before_kill = 0;
    let start = Instant::now();
    // 30 rounds of 1000 writes, 50 ms apart (~20k writes/s); the leader dies after round 10.
    for round in 0..30u32 {
        for i in round * 1000..(round + 1) * 1000 {
            writer
                .try_push(FlowOp::Put {
                    key: flow(i),
                    server: ServerId(i % 7),
                })
                .expect("queue has room");
        }
        if round == 10 {
            acked_before_kill = writer.metrics().written_total;
            cluster.stop_member(killed);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    writer
        .flush(Duration::from_secs(60))
        .await
        .expect("writer recovers and writes everything");
    let m = writer.metrics();
    eprintln!("killed member {killed}; {acked_before_kill} acknowledged before; metrics after {:?}: {m:?}", start.elapsed());
    assert_eq!(m.written_total, u64::from(n));
    assert_eq!(m.backlog, 0);
    assert_eq!(m.overflow_total, 0);
    assert!(!m.retrying);

    // Every write is there, read through the surviving members.
    let all = store.scan_flows().await.unwrap();
    assert_eq!(all.len(), n as usize);
    assert!(all
        .iter()
        .all(|fm| fm.server == ServerId((u32::from(fm.key.client_ip) - 0x0a00_0000) % 7)));

    // The killed member rejoins and catches up; read through it alone.
    cluster.restart_member(killed).expect("restart member");
    let only = EtcdConfig {
        endpoints: vec![cluster.endpoints()[killed].clone()],
        ..config
    };
    let via_restarted = EtcdStore::connect(only).await.unwrap();
    let count = support::eventually(
        Duration::from_secs(10),
        "restarted member catches up",
        || async {
            via_restarted
                .count_flows()
                .await
                .ok()
                .filter(|c| *c == u64::from(n))
        },
    )
    .await;
    assert_eq!(count, u64::from(n));
    writer.close(Duration::from_secs(5)).await.unwrap();
}
