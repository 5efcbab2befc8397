//! The `/v1/events` server-sent event stream.
//!
//! One hub task turns store changes (servers, services, policy, drains),
//! control-plane events (migrations) and a once-a-second load sample into
//! encoded SSE messages on a broadcast channel; every client subscribes to
//! it, so the cost per event does not grow with the number of clients. A
//! client that falls behind gets a `lagged` event naming how many it missed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;
use capybara_proto::flow::ServerId;
use capybara_store::{unix_ms_now, Change, WatchKind};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::apidb::Role;
use crate::auth::authorize;
use crate::control::{ControlEvent, ServerStats, SwitchdLiveness};
use crate::problem::{ApiResult, Problem, Query};
use crate::server::{data_source_json, server_event, service_event, AppState};

pub const EVENT_TYPES: [&str; 7] = [
    "load",
    "server",
    "service",
    "drain",
    "migration",
    "policy",
    "lagged",
];
const KEEPALIVE: Duration = Duration::from_secs(15);
const LOAD_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct SseMessage {
    pub event: &'static str,
    pub frame: Bytes,
}

fn frame(event: &'static str, data: &Value) -> Arc<SseMessage> {
    Arc::new(SseMessage {
        event,
        frame: Bytes::from(format!("event: {event}\ndata: {data}\n\n")),
    })
}

/// Runs until the process ends (the caller aborts it on shutdown).
pub async fn run_hub(state: AppState) {
    let mut cp_events = state.cp.subscribe();
    // switchd's liveness of each server at the last load sample.
    let mut heard: HashMap<ServerId, Option<SwitchdLiveness>> = HashMap::new();
    let mut ticker = tokio::time::interval(LOAD_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let mut watch = match state
            .store
            .watch(&[
                WatchKind::Servers,
                WatchKind::Services,
                WatchKind::Policy,
                WatchKind::Drains,
            ])
            .await
        {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "event hub: store watch failed; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                item = watch.next() => match item {
                    Some(Ok(ev)) => {
                        if state.hub.receiver_count() > 0 {
                            if let Err(e) = publish_change(&state, ev.change).await {
                                tracing::warn!(error = %e, "event hub: building an event failed");
                            }
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "event hub: store watch ended; re-watching");
                        let _ = state.hub.send(frame("lagged", &json!({ "missed": 0, "reason": e.to_string() })));
                        break;
                    }
                    None => break,
                },
                ev = cp_events.recv() => match ev {
                    Ok(ControlEvent::Migration(m)) => { let _ = state.hub.send(frame("migration", &json!(m))); }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = state.hub.send(frame("lagged", &json!({ "missed": n })));
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        // The control plane has no more events; keep serving store events.
                        cp_events = broadcast::channel(1).1;
                    }
                },
                _ = ticker.tick() => {
                    if state.hub.receiver_count() > 0 {
                        match state.cp.server_stats().await {
                            Ok(stats) => {
                                let mut servers: Vec<_> = stats.iter()
                                    .map(|(id, s)| json!({ "id": id.0, "connections": s.connections, "load_pps": s.load_pps }))
                                    .collect();
                                servers.sort_by_key(|v| v["id"].as_u64());
                                let data = json!({ "at_unix_ms": unix_ms_now(), "data_source": data_source_json(state.cp.data_source()), "servers": servers });
                                let _ = state.hub.send(frame("load", &data));
                                publish_liveness_changes(&state, &stats, &mut heard).await;
                            }
                            Err(e) => tracing::warn!(error = %e, "event hub: load sample failed"),
                        }
                    } else {
                        // What nobody heard: the next client starts anew.
                        heard.clear();
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A `server` event for every server whose liveness switchd changed since
/// the last sample. A hostagent that starts stopping (`stopping`) changes
/// no record in the store, so no store change announces it; a death or a
/// clean stop does (switchd writes `dead`), and may be announced twice
/// (a client keeps the newer copy). `heard` is empty at the first sample
/// of a stream that opened with no other client (the caller clears it
/// while nobody listens): the client listed the servers when its stream
/// opened, perhaps before a change, so a server first heard other than
/// live is announced too.
async fn publish_liveness_changes(
    state: &AppState,
    stats: &HashMap<ServerId, ServerStats>,
    heard: &mut HashMap<ServerId, Option<SwitchdLiveness>>,
) {
    heard.retain(|id, _| stats.contains_key(id));
    for (id, s) in stats {
        let changed = match heard.insert(*id, s.live) {
            Some(before) => before != s.live,
            None => !matches!(s.live, None | Some(SwitchdLiveness::Live)),
        };
        if !changed {
            continue;
        }
        match server_event(state, *id, stats).await {
            Ok(ev) if !ev["server"].is_null() => {
                let _ = state.hub.send(frame("server", &ev));
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "event hub: building a server event failed"),
        }
    }
}

async fn publish_change(state: &AppState, change: Change) -> ApiResult<()> {
    let msg = match change {
        Change::ServerPut(s) => frame(
            "server",
            &server_event(state, s.id, &state.cp.server_stats().await?).await?,
        ),
        Change::ServerDeleted(id) => frame("server", &json!({ "id": id.0, "server": null })),
        Change::ServicePut(s) => frame("service", &service_event(&s.name, Some(&s))),
        Change::ServiceDeleted(name) => frame("service", &service_event(&name, None)),
        Change::PolicyPut(p) => frame("policy", &json!(p)),
        Change::DrainPut(d) => {
            // The server's shown state is its drain's: a `server` event
            // too (the drain is not in the server record).
            let server = frame(
                "server",
                &server_event(state, d.server, &state.cp.server_stats().await?).await?,
            );
            let _ = state.hub.send(server);
            match state.cp.drain_status(d.server).await? {
                Some(v) => frame("drain", &json!(v)),
                None => return Ok(()),
            }
        }
        Change::DrainDeleted(_) | Change::AuditAppended(_) | Change::LeaderChanged { .. } => {
            return Ok(())
        }
    };
    let _ = state.hub.send(msg);
    Ok(())
}

pub async fn stream(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = data.get_ref();
    authorize(&req, state, Role::Viewer, true)?;
    let q = Query::parse(&req)?;
    let types: Option<HashSet<&'static str>> = match q.get("types") {
        None | Some("") => None,
        Some(list) => {
            let mut set = HashSet::new();
            for t in list.split(',') {
                match EVENT_TYPES.iter().find(|e| **e == t) {
                    Some(e) => set.insert(*e),
                    None => {
                        return Err(Problem::bad_param(
                            "types",
                            format!("unknown event type {t:?}; known: {}", EVENT_TYPES.join(",")),
                        ))
                    }
                };
            }
            Some(set)
        }
    };
    let rx = state.hub.subscribe();
    let mut keepalive = tokio::time::interval(KEEPALIVE);
    keepalive.reset();
    let first = Bytes::from_static(b": connected\n\n");
    let body = futures::stream::unfold(
        (rx, keepalive, Some(first), types),
        |(mut rx, mut ka, first, types)| async move {
            if let Some(f) = first {
                return Some((Ok::<_, actix_web::Error>(f), (rx, ka, None, types)));
            }
            loop {
                tokio::select! {
                    msg = rx.recv() => match msg {
                        Ok(m) => {
                            if types.as_ref().is_none_or(|t| t.contains(m.event)) {
                                return Some((Ok(m.frame.clone()), (rx, ka, None, types)));
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            let f = Bytes::from(format!("event: lagged\ndata: {}\n\n", json!({ "missed": n })));
                            return Some((Ok(f), (rx, ka, None, types)));
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    },
                    _ = ka.tick() => return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), (rx, ka, None, types))),
                }
            }
        },
    );
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body))
}
