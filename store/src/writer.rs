//! `FlowWriter`: the packet path's only way into the store.
//!
//! `try_push` never blocks and never waits for the store: it puts the
//! operation in a bounded queue or, if the queue is full, counts and reports
//! an `Overflow`. A background task drains the queue in batches (whatever is
//! queued, up to `max_batch`, after lingering at most `linger` for more) and
//! calls `Store::apply_flows`. A failed batch is retried, the same batch, with
//! exponential backoff until it is written, so every operation accepted by
//! `try_push` is eventually written in order, unless the writer is closed
//! with a deadline that passes first (then `close` says how many were left).
//! Metrics expose backlog, batches, batch sizes, overflow, last error and lag.
//!
//! A fenced writer (`spawn_fenced`, switchd HA) writes with
//! `Store::apply_flows_fenced` under the lease in its [`WriteFence`]: with no
//! lease set it writes nothing and waits; a batch the store refuses
//! (`NotLeader`: the lease lapsed or was taken over) is kept, reported
//! through the fence (`take_refused`) and retried only once the owner sets a
//! lease again. Closed without a lease, it drops what is left and `close`
//! says how many: a deposed leader never writes.

// `u64::is_multiple_of` needs Rust 1.87; the workspace supports 1.80.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::model::{FlowOp, LeaderInfo};
use crate::{Store, StoreError};

/// The leadership a fenced [`FlowWriter`] writes under, shared by the lease
/// owner and the writer. The owner `set`s the lease it won and clears it
/// (`set(None)`) when it loses it; the writer reports the lease of a write
/// the store refused, which the owner collects with `take_refused`.
#[derive(Debug, Default)]
pub struct WriteFence {
    current: Mutex<Option<LeaderInfo>>,
    generation: AtomicU64,
    /// Lease id of the last refused write not yet taken (0: none).
    refused: AtomicI64,
}

impl WriteFence {
    pub fn new() -> Arc<Self> {
        Arc::new(WriteFence::default())
    }

    /// Writes go under `lease` from now on (`None`: nothing is written).
    pub fn set(&self, lease: Option<&LeaderInfo>) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = lease.cloned();
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub fn current(&self) -> Option<LeaderInfo> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The lease id of a write the store refused (`NotLeader`) since the
    /// last call, if any.
    pub fn take_refused(&self) -> Option<i64> {
        match self.refused.swap(0, Ordering::AcqRel) {
            0 => None,
            id => Some(id),
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

#[derive(Debug, Clone)]
pub struct FlowWriterConfig {
    /// Queue capacity in operations; beyond it `try_push` reports overflow.
    pub capacity: usize,
    /// Most operations per `apply_flows` call.
    pub max_batch: usize,
    /// After the first queued operation, wait this long for more.
    pub linger: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// A flush that takes longer counts as failed and is retried.
    pub flush_timeout: Duration,
}

impl Default for FlowWriterConfig {
    fn default() -> Self {
        FlowWriterConfig {
            capacity: 262_144,
            max_batch: 4096,
            linger: Duration::from_millis(2),
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(2),
            flush_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverflowReason {
    /// The queue is full: the store is slower than the packet path.
    QueueFull,
    /// The writer was closed.
    WriterClosed,
}

impl std::fmt::Display for OverflowReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OverflowReason::QueueFull => "queue full",
            OverflowReason::WriterClosed => "writer closed",
        })
    }
}

/// `try_push` refused the operation; it is counted in `overflow_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("flow writer overflow ({reason}): queue capacity {capacity}, {overflow_total} operations refused so far")]
pub struct Overflow {
    pub reason: OverflowReason,
    pub capacity: usize,
    pub overflow_total: u64,
}

/// Upper bounds of the batch-size histogram buckets (the last is +Inf).
pub const BATCH_SIZE_BUCKETS: [u64; 7] = [1, 16, 64, 256, 1024, 4096, u64::MAX];

#[derive(Default)]
struct Counters {
    backlog: AtomicU64,
    accepted: AtomicU64,
    written: AtomicU64,
    batches: AtomicU64,
    overflow: AtomicU64,
    flush_errors: AtomicU64,
    retrying: AtomicU64,
    buckets: [AtomicU64; 7],
    last_flush_us: AtomicU64,
    max_flush_us: AtomicU64,
    /// Age of the oldest operation of the last written batch, microseconds.
    last_lag_us: AtomicU64,
    /// Batches the store refused because the fence's lease no longer holds.
    fenced: AtomicU64,
    /// Operations dropped on close because no lease was held.
    abandoned: AtomicU64,
    /// Fenced writer waiting for a lease (none set, or the set one refused).
    waiting_for_lease: AtomicU64,
    close_requested: AtomicBool,
    last_error: Mutex<Option<String>>,
    /// Enqueue time of the first operation of the batch being written.
    oldest_pending: Mutex<Option<Instant>>,
}

/// A point-in-time copy of the writer's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowWriterMetrics {
    /// Accepted but not yet written operations (queued + in the current batch).
    pub backlog: u64,
    pub accepted_total: u64,
    pub written_total: u64,
    pub batches_total: u64,
    pub overflow_total: u64,
    pub flush_errors_total: u64,
    /// Whether the current batch is being retried after an error.
    pub retrying: bool,
    /// Count of batches per size bucket (`BATCH_SIZE_BUCKETS`).
    pub batch_size_buckets: [u64; 7],
    pub last_flush: Duration,
    pub max_flush: Duration,
    /// How long the batch being written has been waiting since its first
    /// operation was queued (zero when idle); grows while the store is down.
    pub lag: Duration,
    pub last_batch_lag: Duration,
    pub last_error: Option<String>,
    /// Fenced writer: batches refused because the lease no longer held.
    pub fenced_total: u64,
    /// Fenced writer: operations dropped at close for want of a lease.
    pub abandoned_total: u64,
    /// Fenced writer: holding its batch until a lease is set.
    pub waiting_for_lease: bool,
}

impl FlowWriterMetrics {
    /// Prometheus text exposition, metric names prefixed `capybara_store_flow_writer_`.
    pub fn to_prometheus(&self) -> String {
        let p = "capybara_store_flow_writer";
        let mut s = String::new();
        let mut line = |name: &str, v: String| s.push_str(&format!("{p}_{name} {v}\n"));
        line("backlog", self.backlog.to_string());
        line("accepted_total", self.accepted_total.to_string());
        line("written_total", self.written_total.to_string());
        line("batches_total", self.batches_total.to_string());
        line("overflow_total", self.overflow_total.to_string());
        line("flush_errors_total", self.flush_errors_total.to_string());
        line("retrying", u8::from(self.retrying).to_string());
        line("fenced_total", self.fenced_total.to_string());
        line("abandoned_total", self.abandoned_total.to_string());
        line(
            "waiting_for_lease",
            u8::from(self.waiting_for_lease).to_string(),
        );
        line("lag_seconds", format!("{:.6}", self.lag.as_secs_f64()));
        line(
            "last_flush_seconds",
            format!("{:.6}", self.last_flush.as_secs_f64()),
        );
        let mut cum = 0;
        for (i, le) in BATCH_SIZE_BUCKETS.iter().enumerate() {
            cum += self.batch_size_buckets[i];
            let le = if *le == u64::MAX {
                "+Inf".to_string()
            } else {
                le.to_string()
            };
            s.push_str(&format!("{p}_batch_size_bucket{{le=\"{le}\"}} {cum}\n"));
        }
        s.push_str(&format!("{p}_batch_size_count {cum}\n"));
        s
    }
}

/// Error of `FlowWriter::close` and `flush` when operations were left unwritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "flow writer: {unwritten} operations still unwritten after {waited:?} (last store error: {})",
    .last_error.as_deref().unwrap_or("none")
)]
pub struct Unflushed {
    pub unwritten: u64,
    pub waited: Duration,
    pub last_error: Option<String>,
}

/// The batching, retrying flow writer. Cheap to share behind an `Arc`.
pub struct FlowWriter {
    tx: mpsc::Sender<(FlowOp, Instant)>,
    shutdown: Arc<tokio::sync::Notify>,
    counters: Arc<Counters>,
    capacity: usize,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl FlowWriter {
    /// Starts the background flusher on the current tokio runtime.
    pub fn spawn(store: Arc<dyn Store>, config: FlowWriterConfig) -> Self {
        Self::start(store, config, None)
    }

    /// Like `spawn`, but every batch is written with
    /// `Store::apply_flows_fenced` under the lease in `fence` (see the
    /// module documentation).
    pub fn spawn_fenced(
        store: Arc<dyn Store>,
        config: FlowWriterConfig,
        fence: Arc<WriteFence>,
    ) -> Self {
        Self::start(store, config, Some(fence))
    }

    fn start(
        store: Arc<dyn Store>,
        config: FlowWriterConfig,
        fence: Option<Arc<WriteFence>>,
    ) -> Self {
        let capacity = config.capacity.max(1);
        let (tx, rx) = mpsc::channel(capacity);
        let counters = Arc::new(Counters::default());
        let shutdown = Arc::new(tokio::sync::Notify::new());
        let task = tokio::spawn(flusher(
            store,
            config,
            fence,
            rx,
            counters.clone(),
            shutdown.clone(),
        ));
        FlowWriter {
            tx,
            shutdown,
            counters,
            capacity,
            task: Mutex::new(Some(task)),
        }
    }

    /// Queues one operation without blocking; refuses it when the queue is full.
    pub fn try_push(&self, op: FlowOp) -> Result<(), Overflow> {
        // Count first so the backlog never reads lower than the truth.
        self.counters.backlog.fetch_add(1, Ordering::AcqRel);
        let res = match self.tx.try_send((op, Instant::now())) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.counters.backlog.fetch_sub(1, Ordering::AcqRel);
                Err(match e {
                    mpsc::error::TrySendError::Full(_) => OverflowReason::QueueFull,
                    mpsc::error::TrySendError::Closed(_) => OverflowReason::WriterClosed,
                })
            }
        };
        match res {
            Ok(()) => {
                self.counters.accepted.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(reason) => {
                let total = self.counters.overflow.fetch_add(1, Ordering::Relaxed) + 1;
                // Log the first overflow and then every 10,000th, never per packet.
                if total == 1 || total % 10_000 == 0 {
                    tracing::warn!(
                        overflow_total = total,
                        backlog = self.counters.backlog.load(Ordering::Relaxed),
                        capacity = self.capacity,
                        ?reason,
                        "flow writer queue overflow: flow mappings are not being persisted"
                    );
                }
                Err(Overflow {
                    reason,
                    capacity: self.capacity,
                    overflow_total: total,
                })
            }
        }
    }

    pub fn metrics(&self) -> FlowWriterMetrics {
        let c = &self.counters;
        let us = |a: &AtomicU64| Duration::from_micros(a.load(Ordering::Relaxed));
        let lag = c
            .oldest_pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|t| t.elapsed())
            .unwrap_or_default();
        FlowWriterMetrics {
            backlog: c.backlog.load(Ordering::Acquire),
            accepted_total: c.accepted.load(Ordering::Relaxed),
            written_total: c.written.load(Ordering::Relaxed),
            batches_total: c.batches.load(Ordering::Relaxed),
            overflow_total: c.overflow.load(Ordering::Relaxed),
            flush_errors_total: c.flush_errors.load(Ordering::Relaxed),
            retrying: c.retrying.load(Ordering::Relaxed) != 0,
            batch_size_buckets: std::array::from_fn(|i| c.buckets[i].load(Ordering::Relaxed)),
            last_flush: us(&c.last_flush_us),
            max_flush: us(&c.max_flush_us),
            lag,
            last_batch_lag: us(&c.last_lag_us),
            last_error: c
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            fenced_total: c.fenced.load(Ordering::Relaxed),
            abandoned_total: c.abandoned.load(Ordering::Relaxed),
            waiting_for_lease: c.waiting_for_lease.load(Ordering::Relaxed) != 0,
        }
    }

    /// Waits until everything accepted so far is written, at most `timeout`.
    pub async fn flush(&self, timeout: Duration) -> Result<(), Unflushed> {
        let target = self.counters.accepted.load(Ordering::Acquire);
        let start = Instant::now();
        // Bounded by `timeout`; polls every millisecond.
        while self.counters.written.load(Ordering::Acquire) < target {
            if start.elapsed() >= timeout {
                let m = self.metrics();
                return Err(Unflushed {
                    unwritten: m.backlog,
                    waited: start.elapsed(),
                    last_error: m.last_error,
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// Stops accepting, writes what is queued (retrying until `deadline`),
    /// then stops the flusher. Reports how many operations were left (a
    /// fenced writer without a lease drops them at once).
    pub async fn close(&self, deadline: Duration) -> Result<(), Unflushed> {
        self.counters.close_requested.store(true, Ordering::Release);
        self.shutdown.notify_one();
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        let start = Instant::now();
        if let Some(mut task) = task {
            if tokio::time::timeout(deadline, &mut task).await.is_err() {
                task.abort();
                let m = self.metrics();
                return Err(Unflushed {
                    unwritten: m.backlog,
                    waited: start.elapsed(),
                    last_error: m.last_error,
                });
            }
        }
        let m = self.metrics();
        if m.abandoned_total > 0 {
            return Err(Unflushed {
                unwritten: m.abandoned_total,
                waited: start.elapsed(),
                last_error: m.last_error,
            });
        }
        Ok(())
    }
}

impl Drop for FlowWriter {
    fn drop(&mut self) {
        // The flusher writes what is queued, then ends.
        self.counters.close_requested.store(true, Ordering::Release);
        self.shutdown.notify_one();
    }
}

fn bucket(n: usize) -> usize {
    BATCH_SIZE_BUCKETS
        .iter()
        .position(|b| n as u64 <= *b)
        .unwrap_or(BATCH_SIZE_BUCKETS.len() - 1)
}

/// Drops the batch and everything still queued (a fenced writer closed
/// without a lease); counts them.
fn abandon(batch: &[FlowOp], rx: &mut mpsc::Receiver<(FlowOp, Instant)>, c: &Counters) {
    rx.close();
    let mut n = batch.len() as u64;
    // Bounded: the queue is closed, so it only empties.
    while rx.try_recv().is_ok() {
        n += 1;
    }
    c.abandoned.fetch_add(n, Ordering::Relaxed);
    c.backlog.fetch_sub(n, Ordering::AcqRel);
    *c.oldest_pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
    tracing::warn!(
        abandoned = n,
        "flow writer closed without the leader lease: unwritten flow operations dropped"
    );
}

/// Waits until the fence changes (from `generation`) or close is requested.
async fn wait_for_fence(fence: &WriteFence, generation: u64, c: &Counters) {
    c.waiting_for_lease.store(1, Ordering::Relaxed);
    // Bounded by a fence change or close; sleeps 5 ms per round.
    while fence.generation() == generation && !c.close_requested.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn flusher(
    store: Arc<dyn Store>,
    config: FlowWriterConfig,
    fence: Option<Arc<WriteFence>>,
    mut rx: mpsc::Receiver<(FlowOp, Instant)>,
    c: Arc<Counters>,
    shutdown: Arc<tokio::sync::Notify>,
) {
    let max_batch = config.max_batch.max(1);
    let mut batch: Vec<FlowOp> = Vec::with_capacity(max_batch);
    let mut closing = false;
    loop {
        batch.clear();
        let next = if closing {
            rx.recv().await
        } else {
            tokio::select! {
                m = rx.recv() => m,
                _ = shutdown.notified() => {
                    // Refuse new operations, then drain what was accepted.
                    rx.close();
                    closing = true;
                    continue;
                }
            }
        };
        let Some((first, first_at)) = next else {
            return;
        };
        batch.push(first);
        let linger_until = tokio::time::Instant::now() + config.linger;
        // Bounded by max_batch and by the linger deadline.
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok((op, _)) => batch.push(op),
                Err(mpsc::error::TryRecvError::Empty) => {
                    match tokio::time::timeout_at(linger_until, rx.recv()).await {
                        Ok(Some((op, _))) => batch.push(op),
                        Ok(None) | Err(_) => break,
                    }
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        }
        *c.oldest_pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(first_at);
        let mut backoff = config.initial_backoff;
        let mut attempt: u64 = 0;
        // Retries until written: an accepted operation is never dropped.
        // Each iteration sleeps at least `backoff`, so the loop cannot spin.
        loop {
            attempt += 1;
            // Fenced: the lease to write under, read after its generation
            // so that a change in between is seen by `wait_for_fence`.
            let (generation, lease) = match &fence {
                Some(f) => (f.generation(), f.current()),
                None => (0, None),
            };
            if let (Some(f), None) = (&fence, &lease) {
                if c.close_requested.load(Ordering::Acquire) {
                    abandon(&batch, &mut rx, &c);
                    return;
                }
                wait_for_fence(f, generation, &c).await;
                continue;
            }
            let t0 = Instant::now();
            let write = async {
                match &lease {
                    Some(l) => store.apply_flows_fenced(&batch, l).await,
                    None => store.apply_flows(&batch).await,
                }
            };
            let res = match tokio::time::timeout(config.flush_timeout, write).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::Timeout {
                    op: "apply_flows",
                    after: config.flush_timeout,
                }),
            };
            let took = t0.elapsed();
            match res {
                Err(e @ StoreError::NotLeader { .. }) if fence.is_some() && lease.is_some() => {
                    // A deposed leader: keep the batch, tell the owner, and
                    // write nothing until it sets a lease again.
                    let (Some(f), Some(l)) = (fence.as_ref(), lease.as_ref()) else {
                        continue;
                    };
                    c.fenced.fetch_add(1, Ordering::Relaxed);
                    f.refused.store(l.lease_id, Ordering::Release);
                    tracing::warn!(error = %e, batch = batch.len(), "flow writer: the store refused a fenced write; holding it until a lease is set");
                    *c.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    if c.close_requested.load(Ordering::Acquire) {
                        abandon(&batch, &mut rx, &c);
                        return;
                    }
                    wait_for_fence(f, generation, &c).await;
                }
                Ok(()) => {
                    c.waiting_for_lease.store(0, Ordering::Relaxed);
                    let n = batch.len() as u64;
                    c.last_flush_us
                        .store(took.as_micros() as u64, Ordering::Relaxed);
                    c.max_flush_us
                        .fetch_max(took.as_micros() as u64, Ordering::Relaxed);
                    c.last_lag_us
                        .store(first_at.elapsed().as_micros() as u64, Ordering::Relaxed);
                    c.batches.fetch_add(1, Ordering::Relaxed);
                    c.buckets[bucket(batch.len())].fetch_add(1, Ordering::Relaxed);
                    c.written.fetch_add(n, Ordering::AcqRel);
                    let left = c.backlog.fetch_sub(n, Ordering::AcqRel) - n;
                    if attempt > 1 {
                        tracing::info!(
                            attempts = attempt,
                            backlog = left,
                            "flow writer recovered; store writes resumed"
                        );
                    }
                    c.retrying.store(0, Ordering::Relaxed);
                    *c.oldest_pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
                    break;
                }
                Err(e) => {
                    let e = e.to_string();
                    c.flush_errors.fetch_add(1, Ordering::Relaxed);
                    c.retrying.store(1, Ordering::Relaxed);
                    let backlog = c.backlog.load(Ordering::Relaxed);
                    if attempt == 1 || attempt % 10 == 0 {
                        tracing::warn!(attempt, backlog, batch = batch.len(), retry_in = ?backoff, error = %e, "flow writer cannot reach the store; retrying");
                    }
                    *c.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(config.max_backoff);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Operators read these in logs: words, not Rust values.
    #[test]
    fn errors_read_as_sentences() {
        let o = Overflow {
            reason: OverflowReason::QueueFull,
            capacity: 8,
            overflow_total: 3,
        };
        assert_eq!(
            o.to_string(),
            "flow writer overflow (queue full): queue capacity 8, 3 operations refused so far"
        );
        let u = Unflushed {
            unwritten: 2,
            waited: Duration::from_secs(5),
            last_error: Some("database is locked".into()),
        };
        assert_eq!(
            u.to_string(),
            "flow writer: 2 operations still unwritten after 5s (last store error: database is locked)"
        );
        let u = Unflushed {
            last_error: None,
            ..u
        };
        assert!(u.to_string().ends_with("(last store error: none)"), "{u}");
    }
}
