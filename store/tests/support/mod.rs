//! Fixtures shared by the integration tests: a store under test plus a
//! second, independent handle on the same backend (another connection or
//! client, standing in for another process).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_store::testing::EtcdCluster;
use capybara_store::*;
use futures::StreamExt;

pub struct Fixture {
    pub store: Arc<dyn Store>,
    pub second: Arc<dyn Store>,
    _guard: Box<dyn std::any::Any + Send>,
}

pub async fn sqlite_fixture() -> Fixture {
    let dir = tempfile::Builder::new()
        .prefix("capybara-store-")
        .tempdir()
        .expect("temp dir");
    let config = SqliteConfig {
        watch_poll_interval_ms: 20,
        ..SqliteConfig::at(dir.path().join("store.db"))
    };
    let store = SqliteStore::open(config.clone())
        .await
        .expect("open sqlite");
    let second = SqliteStore::open(config).await.expect("open sqlite again");
    Fixture {
        store: Arc::new(store),
        second: Arc::new(second),
        _guard: Box::new(dir),
    }
}

pub async fn etcd_fixture() -> Fixture {
    let cluster = EtcdCluster::start(1).expect("start etcd");
    let mut config = cluster.store_config();
    // Small transactions so that batches exercise chunking.
    config.max_txn_ops = 1000;
    let store = EtcdStore::connect(config.clone())
        .await
        .expect("connect etcd");
    let second = EtcdStore::connect(config)
        .await
        .expect("connect etcd again");
    Fixture {
        store: Arc::new(store),
        second: Arc::new(second),
        _guard: Box::new(cluster),
    }
}

/// Next event of a watch, or panic after `timeout`.
pub async fn next_event(w: &mut WatchStream, timeout: Duration) -> WatchEvent {
    match tokio::time::timeout(timeout, w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        Ok(Some(Err(e))) => panic!("watch error: {e}"),
        Ok(None) => panic!("watch ended"),
        Err(_) => panic!("no watch event within {timeout:?}"),
    }
}

/// Asserts that no event arrives within `window`.
pub async fn no_event(w: &mut WatchStream, window: Duration) {
    if let Ok(Some(ev)) = tokio::time::timeout(window, w.next()).await {
        panic!("unexpected watch event {ev:?}");
    }
}

/// Polls `f` every 50 ms until it returns `Some`, at most `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("{what}: not reached within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
