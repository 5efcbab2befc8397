//! `/metrics` in the Prometheus text exposition format, and the store probe
//! behind `capybara_store_lag_seconds`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix_web::{web, HttpResponse, ResponseError};
use capybara_store::{DrainState, ServerState};

use crate::problem::ApiResult;
use crate::server::AppState;

const PROBE_INTERVAL: Duration = Duration::from_secs(1);
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Default)]
pub struct Metrics {
    /// Responses by status class 1xx..5xx.
    pub requests: [AtomicU64; 5],
    /// Round trip of the last store probe; `None` if it failed.
    store_probe: Mutex<Option<Duration>>,
}

impl Metrics {
    pub fn count_response(&self, status: u16) {
        let class = (status / 100).clamp(1, 5) as usize - 1;
        self.requests[class].fetch_add(1, Ordering::Relaxed);
    }
    pub fn record_store_probe(&self, rtt: Option<Duration>) {
        *self.store_probe.lock().unwrap_or_else(|p| p.into_inner()) = rtt;
    }
    fn store_probe(&self) -> Option<Duration> {
        *self.store_probe.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Measures a store read once a second (the lag an API call sees).
pub async fn run_store_probe(state: AppState) {
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    loop {
        tick.tick().await;
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(5), state.store.get_policy()).await;
        state
            .metrics
            .record_store_probe(matches!(r, Ok(Ok(_))).then(|| t.elapsed()));
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub async fn metrics(data: web::Data<AppState>) -> HttpResponse {
    match render(data.get_ref()).await {
        Ok(text) => HttpResponse::Ok()
            .content_type("text/plain; version=0.0.4; charset=utf-8")
            .body(text),
        Err(p) => p.error_response(),
    }
}

async fn render(state: &AppState) -> ApiResult<String> {
    let servers = state.store.list_servers().await?;
    let stats = state.cp.server_stats().await?;
    let drains = state.store.list_drains().await?;
    let mut o = String::new();
    let w = &mut o;
    let live = matches!(state.cp.data_source(), crate::control::DataSource::Switchd);
    let _ = writeln!(w, "# HELP capybara_control_plane_live 1 if load and connections come from a running switchd, 0 if from the store.");
    let _ = writeln!(
        w,
        "# TYPE capybara_control_plane_live gauge\ncapybara_control_plane_live {}",
        u8::from(live)
    );

    let _ = writeln!(
        w,
        "# HELP capybara_server_connections Connections owned by the server."
    );
    let _ = writeln!(w, "# TYPE capybara_server_connections gauge");
    for s in &servers {
        let c = stats.get(&s.id).map(|x| x.connections).unwrap_or(0);
        let _ = writeln!(
            w,
            "capybara_server_connections{{server=\"{}\",name=\"{}\"}} {c}",
            s.id.0,
            esc(&s.name)
        );
    }
    let _ = writeln!(w, "# HELP capybara_server_load_pps Request packets (client packets carrying TCP payload) per second seen by the pool monitor (absent when not live).");
    let _ = writeln!(w, "# TYPE capybara_server_load_pps gauge");
    for s in &servers {
        if let Some(l) = stats.get(&s.id).and_then(|x| x.load_pps) {
            let _ = writeln!(
                w,
                "capybara_server_load_pps{{server=\"{}\",name=\"{}\"}} {l}",
                s.id.0,
                esc(&s.name)
            );
        }
    }
    let _ = writeln!(w, "# HELP capybara_server_weight Placement weight.");
    let _ = writeln!(w, "# TYPE capybara_server_weight gauge");
    for s in &servers {
        let _ = writeln!(
            w,
            "capybara_server_weight{{server=\"{}\",name=\"{}\"}} {}",
            s.id.0,
            esc(&s.name),
            s.weight
        );
    }
    let _ = writeln!(
        w,
        "# HELP capybara_server_state 1 for the server's current lifecycle state."
    );
    let _ = writeln!(w, "# TYPE capybara_server_state gauge");
    let drain_of: std::collections::HashMap<_, _> =
        drains.iter().map(|d| (d.server, d.state)).collect();
    for s in &servers {
        // As the REST API shows it: the operator's drain over liveness.
        let shown = capybara_store::shown_state(s, drain_of.get(&s.id).copied());
        for st in [
            ServerState::Active,
            ServerState::Draining,
            ServerState::Drained,
            ServerState::Dead,
        ] {
            let _ = writeln!(
                w,
                "capybara_server_state{{server=\"{}\",name=\"{}\",state=\"{}\"}} {}",
                s.id.0,
                esc(&s.name),
                st.as_str(),
                u8::from(shown == st)
            );
        }
    }
    let _ = writeln!(w, "# HELP capybara_drain_remaining_connections Connections left on a server whose drain is running or timed out.");
    let _ = writeln!(w, "# TYPE capybara_drain_remaining_connections gauge");
    for d in drains
        .iter()
        .filter(|d| matches!(d.state, DrainState::Running | DrainState::TimedOut))
    {
        let _ = writeln!(
            w,
            "capybara_drain_remaining_connections{{server=\"{}\"}} {}",
            d.server.0, d.progress.flows_remaining
        );
    }

    let m = state.cp.migration_metrics();
    let _ = writeln!(
        w,
        "# HELP capybara_migrations_total Finished migrations by outcome."
    );
    let _ = writeln!(w, "# TYPE capybara_migrations_total counter");
    for (outcome, n) in &m.by_outcome {
        let _ = writeln!(w, "capybara_migrations_total{{outcome=\"{outcome}\"}} {n}");
    }
    let _ = writeln!(
        w,
        "# HELP capybara_migration_phase_seconds Duration of each migration phase."
    );
    let _ = writeln!(w, "# TYPE capybara_migration_phase_seconds histogram");
    for (phase, h) in &m.phase_histograms {
        for (le, n) in &h.buckets {
            let _ = writeln!(
                w,
                "capybara_migration_phase_seconds_bucket{{phase=\"{phase}\",le=\"{le}\"}} {n}"
            );
        }
        let _ = writeln!(
            w,
            "capybara_migration_phase_seconds_bucket{{phase=\"{phase}\",le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(
            w,
            "capybara_migration_phase_seconds_sum{{phase=\"{phase}\"}} {}",
            h.sum
        );
        let _ = writeln!(
            w,
            "capybara_migration_phase_seconds_count{{phase=\"{phase}\"}} {}",
            h.count
        );
    }

    let probe = state.metrics.store_probe();
    let _ = writeln!(
        w,
        "# HELP capybara_store_lag_seconds Round trip of the last store read probe (every second)."
    );
    let _ = writeln!(w, "# TYPE capybara_store_lag_seconds gauge");
    if let Some(p) = probe {
        let _ = writeln!(
            w,
            "capybara_store_lag_seconds{{backend=\"{}\"}} {}",
            state.store.backend(),
            p.as_secs_f64()
        );
    }
    let _ = writeln!(
        w,
        "# HELP capybara_store_up 1 if the last store probe succeeded."
    );
    let _ = writeln!(w, "# TYPE capybara_store_up gauge");
    let _ = writeln!(
        w,
        "capybara_store_up{{backend=\"{}\"}} {}",
        state.store.backend(),
        u8::from(probe.is_some())
    );
    let _ = writeln!(
        w,
        "# HELP capybara_api_requests_total API responses by status class."
    );
    let _ = writeln!(w, "# TYPE capybara_api_requests_total counter");
    for (i, c) in CLASSES.iter().enumerate() {
        let _ = writeln!(
            w,
            "capybara_api_requests_total{{class=\"{c}\"}} {}",
            state.metrics.requests[i].load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        w,
        "# HELP capybara_api_sse_clients Open /v1/events streams."
    );
    let _ = writeln!(w, "# TYPE capybara_api_sse_clients gauge");
    let _ = writeln!(w, "capybara_api_sse_clients {}", state.hub.receiver_count());
    Ok(o)
}
