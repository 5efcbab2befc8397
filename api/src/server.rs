//! The actix-web server: configuration, routes and handlers.
//!
//! Every handler authenticates first (so an anonymous caller learns nothing
//! from validation errors; `authorize` then refuses a query parameter the
//! route does not take, `TakesQuery`), then parses path, query and body,
//! then acts, then appends the mutation to the audit log.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::{ServerHandle, Service as _};
use actix_web::http::header;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer, ResponseError};
use capybara_proto::flow::ServerId;
use capybara_store::{AuditRecord, DrainState, Policy, Server, ServerState, Service, Store};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::apidb::{ApiDb, ApiDbError, DrainMode, Role};
use crate::auth::{authorize, Principal};
use crate::control::{
    parse_connection_id, ConnectionFilter, ControlPlane, DataSource, DrainSpec, DrainView,
    ServerStats, ServiceServing, ServicesStatus, SwitchdLiveness,
};
use crate::events::{self, SseMessage};
use crate::metrics::Metrics;
use crate::problem::{
    parse_body, parse_server_id, read_json, valid_name, ApiResult, Problem, Query,
};

/// Everything needed to run the API.
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub store: Arc<dyn Store>,
    pub control_plane: Arc<dyn ControlPlane>,
    pub db: Arc<ApiDb>,
    /// The dashboard's built assets, served at `/`.
    pub static_dir: Option<PathBuf>,
    /// HTTP worker threads (default 2).
    pub workers: usize,
    /// The switch's own addresses (see `SwitchAddrs`).
    pub switch_addrs: SwitchAddrs,
}

/// The switch's own addresses, each with what it is in the operator's
/// words (e.g. `switchd.control_listen`): no service VIP and no server data
/// address may be one of them. Called at each check, so interface addresses
/// added or removed while the API runs count.
pub type SwitchAddrs = Arc<dyn Fn() -> Vec<(Ipv4Addr, String)> + Send + Sync>;

/// A fixed list of the switch's own addresses (none: the API does not know
/// the switch's configuration).
pub fn fixed_switch_addrs(addrs: Vec<(Ipv4Addr, String)>) -> SwitchAddrs {
    Arc::new(move || addrs.clone())
}

/// Shared by all handlers.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub cp: Arc<dyn ControlPlane>,
    pub db: Arc<ApiDb>,
    pub hub: broadcast::Sender<Arc<SseMessage>>,
    pub metrics: Arc<Metrics>,
    /// Serializes check-then-write sequences (unique ids, names, VIPs)
    /// within this process.
    pub write_lock: Arc<tokio::sync::Mutex<()>>,
    pub switch_addrs: SwitchAddrs,
}

/// A started server.
pub struct RunningApi {
    pub addr: SocketAddr,
    pub handle: ServerHandle,
    pub join: tokio::task::JoinHandle<std::io::Result<()>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningApi {
    /// Once listening, without a token file: creates the first admin token
    /// if none exists and prints it once (a start that then failed to bind
    /// would have lost it with its output). On a store error the server is
    /// stopped and the error returned.
    pub async fn show_first_admin_token(
        self,
        db: &crate::ApiDb,
    ) -> Result<Self, crate::apidb::ApiDbError> {
        match db.bootstrap_admin(None) {
            Ok(Some(secret)) => println!("admin token (shown once): {secret}"),
            Ok(None) => {}
            Err(e) => {
                self.stop().await;
                return Err(e);
            }
        }
        Ok(self)
    }

    /// Stops accepting, closes open streams and waits for the workers.
    pub async fn stop(self) {
        self.handle.stop(true).await;
        for b in &self.background {
            b.abort();
        }
        let _ = self.join.await;
    }
}

/// Binds and starts the API (and its background tasks: the event hub and
/// the store probe) on the current Tokio runtime.
pub async fn start(config: ApiConfig) -> std::io::Result<RunningApi> {
    let (hub, _) = broadcast::channel(1024);
    let state = AppState {
        store: config.store,
        cp: config.control_plane,
        db: config.db,
        hub,
        metrics: Arc::new(Metrics::default()),
        write_lock: Arc::new(tokio::sync::Mutex::new(())),
        switch_addrs: config.switch_addrs,
    };
    let background = vec![
        tokio::spawn(events::run_hub(state.clone())),
        tokio::spawn(crate::metrics::run_store_probe(state.clone())),
    ];
    let static_dir = config.static_dir.clone();
    let st = state.clone();
    let server = HttpServer::new(move || {
        let metrics = st.metrics.clone();
        App::new()
            .app_data(web::Data::new(st.clone()))
            .wrap_fn(move |req, srv| {
                let metrics = metrics.clone();
                let fut = srv.call(req);
                async move {
                    let res = fut.await?;
                    metrics.count_response(res.status().as_u16());
                    Ok(res)
                }
            })
            .configure(|cfg| routes(cfg, static_dir.clone()))
    })
    .workers(config.workers.max(1))
    .shutdown_timeout(2)
    .disable_signals()
    .bind(config.listen)?;
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    let join = tokio::spawn(server);
    Ok(RunningApi {
        addr,
        handle,
        join,
        background,
    })
}

fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move || async move {
        Problem::method_not_allowed(allow).error_response()
    }))
}

/// The query parameters a route's methods take (openapi.yaml's `in:
/// query`), declared next to its handlers in [`routes`]: `("GET", &["after",
/// "limit"])`. A method the route declares nothing for takes none.
/// [`authorize`] refuses any other parameter after authenticating the
/// caller (400 naming it): a misspelt filter (`?servr=2`) or option must
/// not be ignored as if the request had not asked for it, and a new route
/// cannot forget the check. It refuses one given twice (`?limit=1&limit=2`)
/// the same way, rather than take one of the two silently.
#[derive(Clone, Copy)]
pub struct TakesQuery(pub &'static [(&'static str, &'static [&'static str])]);

/// Refuses a query parameter the route does not take for the request's
/// method ([`TakesQuery`]) or one given twice; a malformed query string is
/// a 400 too.
pub fn check_query(req: &HttpRequest) -> ApiResult<()> {
    let takes = req
        .app_data::<TakesQuery>()
        .and_then(|t| t.0.iter().find(|(m, _)| *m == req.method().as_str()))
        .map_or(&[][..], |(_, p)| p);
    Query::parse(req)?.only(takes).map(|_| ())
}

/// Registers every route of `openapi.yaml` (and the dashboard, if any),
/// with the query parameters each takes (`TakesQuery`; none unless
/// declared). `/metrics`, `/healthz`, `/readyz` and the dashboard's files
/// ignore the query: probes, scrapers and cache-busting `?v=` may add one.
pub fn routes(cfg: &mut web::ServiceConfig, static_dir: Option<PathBuf>) {
    cfg.service(
        resource("/v1/servers", "GET, POST")
            .route(web::get().to(list_servers))
            .route(web::post().to(register_server)),
    )
    .service(
        resource("/v1/servers/{server_id}", "GET, DELETE")
            .route(web::get().to(get_server))
            .route(web::delete().to(deregister_server)),
    )
    .service(
        resource("/v1/servers/{server_id}/weight", "PUT, DELETE")
            .route(web::put().to(set_weight))
            .route(web::delete().to(clear_weight)),
    )
    .service(
        resource("/v1/servers/{server_id}/drain", "GET, POST")
            .route(web::get().to(get_drain))
            .route(web::post().to(drain_server)),
    )
    .service(
        resource("/v1/servers/{server_id}/undrain", "POST").route(web::post().to(undrain_server)),
    )
    .service(
        resource("/v1/services", "GET, POST")
            .route(web::get().to(list_services))
            .route(web::post().to(create_service)),
    )
    .service(
        resource("/v1/services/{service_name}", "GET, PUT, DELETE")
            .route(web::get().to(get_service))
            .route(web::put().to(update_service))
            .route(web::delete().to(delete_service)),
    )
    .service(
        resource("/v1/connections", "GET")
            .app_data(TakesQuery(&[("GET", &["server", "service", "limit"])]))
            .route(web::get().to(list_connections)),
    )
    .service(
        resource("/v1/connections/{connection_id}/migrate", "POST")
            .route(web::post().to(migrate_connection)),
    )
    .service(
        resource("/v1/migrations", "GET")
            .app_data(TakesQuery(&[("GET", &["after", "limit", "order"])]))
            .route(web::get().to(list_migrations)),
    )
    .service(
        resource("/v1/policy", "GET, PUT, PATCH")
            .route(web::get().to(get_policy))
            .route(web::put().to(put_policy))
            .route(web::patch().to(patch_policy)),
    )
    .service(
        resource("/v1/tokens", "GET, POST")
            .route(web::get().to(list_tokens))
            .route(web::post().to(create_token)),
    )
    .service(resource("/v1/tokens/{token_id}", "DELETE").route(web::delete().to(revoke_token)))
    .service(resource("/v1/whoami", "GET").route(web::get().to(whoami)))
    .service(
        resource("/v1/events", "GET")
            .app_data(TakesQuery(&[("GET", &["types", "access_token"])]))
            .route(web::get().to(events::stream)),
    )
    .service(
        resource("/v1/audit", "GET")
            .app_data(TakesQuery(&[("GET", &["after", "limit", "order"])]))
            .route(web::get().to(list_audit)),
    )
    .service(resource("/metrics", "GET").route(web::get().to(crate::metrics::metrics)))
    .service(resource("/healthz", "GET").route(web::get().to(healthz)))
    .service(resource("/readyz", "GET").route(web::get().to(readyz)));
    if let Some(dir) = static_dir {
        // Routed for GET and HEAD only: other methods on an unknown path
        // reach the default service (a 404 problem document) instead of
        // actix-files' own text/plain 405 without an Allow header.
        cfg.service(
            actix_files::Files::new("/", dir)
                .guard(actix_web::guard::Any(actix_web::guard::Get()).or(actix_web::guard::Head()))
                .index_file("index.html")
                .default_handler(web::to(|| async { not_found_route().await })),
        );
    }
    cfg.default_service(web::to(not_found_route));
}

async fn not_found_route() -> HttpResponse {
    Problem::not_found("no such route; see /v1 in openapi.yaml").error_response()
}

fn st(data: &web::Data<AppState>) -> &AppState {
    data.get_ref()
}

fn json_response<T: Serialize>(status: actix_web::http::StatusCode, v: &T) -> HttpResponse {
    HttpResponse::build(status)
        .content_type("application/json")
        .body(serde_json::to_string(v).unwrap_or_default())
}

fn ok<T: Serialize>(v: &T) -> HttpResponse {
    json_response(actix_web::http::StatusCode::OK, v)
}

/// Appends an audit entry. The mutation already happened, so a failing
/// audit append is logged loudly rather than reported as a failure.
async fn audit(state: &AppState, who: &Principal, action: &str, target: String, detail: Value) {
    let rec = AuditRecord {
        actor: who.actor(),
        action: action.to_string(),
        target,
        detail,
    };
    if let Err(e) = state.store.append_audit(&rec).await {
        tracing::error!(error = %e, action, "audit append failed");
    }
}

// ----- servers

#[derive(Serialize)]
pub struct ServerView {
    pub id: u32,
    pub name: String,
    pub mgmt_addr: String,
    pub data_addr: String,
    /// The operator's drain while it holds the server (`draining`,
    /// `drained`), else its liveness as switchd last recorded it
    /// (`active`, `dead`): `capybara_store::shown_state`.
    pub state: ServerState,
    /// Whether the server's hostagent is heard: `never_seen` (created
    /// through the API, no hostagent has registered it: switchd places no
    /// connection on it), `live`, `stopping` (its hostagent migrates its
    /// connections away before it exits), `stopped` (its hostagent stopped
    /// cleanly), `dead` (missed its heartbeats). Apart from `state`, which
    /// keeps the operator's drain.
    pub liveness: &'static str,
    pub weight: u32,
    /// `operator`: `weight` was set through the API (REST, `ctl weight`,
    /// dashboard) and outlives the server's REGISTERs until cleared;
    /// `register`: the weight the server's hostagent reports.
    pub weight_source: &'static str,
    /// While `weight_source` is `operator`: the REGISTER's weight, which
    /// clearing the operator's brings back (null when not known).
    pub register_weight: Option<u32>,
    pub registered_unix_ms: u64,
    pub updated_unix_ms: u64,
    pub stats: ServerStats,
    pub drain: Option<DrainView>,
}

pub async fn server_view(
    state: &AppState,
    s: Server,
    stats: Option<ServerStats>,
) -> ApiResult<ServerView> {
    let stats = match stats {
        Some(st) => st,
        None => state
            .cp
            .server_stats()
            .await?
            .get(&s.id)
            .copied()
            .unwrap_or(ServerStats {
                data_source: state.cp.data_source(),
                connections: 0,
                load_pps: None,
                apps_down: None,
                live: None,
            }),
    };
    let drain = state.cp.drain_status(s.id).await?;
    let liveness = server_liveness(&s, &stats);
    let shown = capybara_store::shown_state(&s, drain.as_ref().map(|d| d.state));
    Ok(ServerView {
        id: s.id.0,
        name: s.name,
        mgmt_addr: s.mgmt_addr.to_string(),
        data_addr: s.data_addr.to_string(),
        state: shown,
        liveness,
        weight: s.weight,
        weight_source: if s.weight_set { "operator" } else { "register" },
        register_weight: if s.weight_set {
            s.register_weight
        } else {
            None
        },
        registered_unix_ms: s.registered_unix_ms,
        updated_unix_ms: s.updated_unix_ms,
        stats,
        drain,
    })
}

/// A server's `liveness`: switchd's when it holds the server (`stopping`
/// and `stopped` only switchd knows), else the record's (`dead` as switchd
/// last wrote it); `never_seen` for a record no hostagent has registered,
/// whatever its `state` or switchd says.
fn server_liveness(s: &Server, stats: &ServerStats) -> &'static str {
    if !s.hostagent_seen() {
        return "never_seen";
    }
    match stats.live {
        Some(SwitchdLiveness::Stopped) => "stopped",
        Some(SwitchdLiveness::Dead) => "dead",
        Some(SwitchdLiveness::Stopping) => "stopping",
        Some(SwitchdLiveness::Live) => "live",
        None if s.state == ServerState::Dead => "dead",
        None => "live",
    }
}

/// What `addr` is when it is one of the switch's own addresses.
fn switch_addr(state: &AppState, addr: Ipv4Addr) -> Option<String> {
    (state.switch_addrs)()
        .into_iter()
        .chain(state.cp.switch_addrs())
        .find(|(a, _)| *a == addr)
        .map(|(_, what)| what)
}

async fn existing_server(state: &AppState, raw: &str) -> ApiResult<Server> {
    let id = parse_server_id(raw)?;
    state
        .store
        .get_server(id)
        .await?
        .ok_or_else(|| Problem::not_found(format!("server {} not found", id.0)))
}

async fn list_servers(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let stats = state.cp.server_stats().await?;
    let mut items = Vec::new();
    for s in state.store.list_servers().await? {
        let sst = stats.get(&s.id).copied();
        items.push(
            server_view(
                state,
                s,
                sst.or(Some(ServerStats {
                    data_source: state.cp.data_source(),
                    connections: 0,
                    load_pps: None,
                    apps_down: None,
                    live: None,
                })),
            )
            .await?,
        );
    }
    Ok(ok(&json!({ "items": items })))
}

async fn get_server(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let s = existing_server(state, &path).await?;
    Ok(ok(&server_view(state, s, None).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegisterBody {
    id: Option<u64>,
    name: String,
    mgmt_addr: String,
    data_addr: String,
    weight: Option<u64>,
}

fn check_weight(field: &str, w: u64) -> ApiResult<u32> {
    if w > 65535 {
        return Err(Problem::invalid(
            field,
            format!("must be in [0, 65535], got {w}"),
        ));
    }
    Ok(w as u32)
}

async fn register_server(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let body = read_json(&req, payload, true).await?.unwrap_or(Value::Null);
    let b: RegisterBody = parse_body(body.clone())?;
    if let Some(id) = b.id {
        if !(1..=u32::MAX as u64).contains(&id) {
            return Err(Problem::invalid(
                "id",
                format!("must be in [1, 4294967295], got {id}"),
            ));
        }
    }
    if !valid_name(&b.name) {
        return Err(Problem::invalid(
            "name",
            "must be 1-64 characters of [A-Za-z0-9_.-]",
        ));
    }
    let mgmt: SocketAddr = b.mgmt_addr.parse().map_err(|_| {
        Problem::invalid(
            "mgmt_addr",
            format!("must be IPv4:port, got {:?}", b.mgmt_addr),
        )
    })?;
    if mgmt.port() == 0 {
        return Err(Problem::invalid("mgmt_addr", "port must not be 0"));
    }
    let data_addr: Ipv4Addr = b.data_addr.parse().map_err(|_| {
        Problem::invalid(
            "data_addr",
            format!("must be an IPv4 address, got {:?}", b.data_addr),
        )
    })?;
    // The address switchd forwards the server's connections to: no host
    // has an unspecified, broadcast or multicast one.
    if data_addr.is_unspecified() || data_addr.is_broadcast() || data_addr.is_multicast() {
        return Err(Problem::invalid(
            "data_addr",
            format!("must be a unicast address, got {data_addr}"),
        ));
    }
    let weight = check_weight("weight", b.weight.unwrap_or(100))?;
    if let Some(what) = switch_addr(state, data_addr) {
        return Err(Problem::invalid(
            "data_addr",
            format!("{data_addr} is the switch's own address ({what}), not a server's"),
        ));
    }
    let _g = state.write_lock.lock().await;
    let existing = state.store.list_servers().await?;
    if existing.iter().any(|s| s.name == b.name) {
        return Err(Problem::conflict(format!(
            "a server named {:?} is already registered",
            b.name
        )));
    }
    // switchd forwards each server's connections to its data address: two
    // servers at one address would get each other's connections.
    if let Some(other) = existing.iter().find(|s| s.data_addr == data_addr) {
        return Err(Problem::conflict(format!(
            "data address {data_addr} is already that of server {} ({:?}); each server needs its own",
            other.id.0, other.name
        ))
        .with_field("data_addr"));
    }
    // A service there would take this server's traffic (the VIP check's
    // other side).
    if let Some(svc) = state
        .store
        .list_services()
        .await?
        .into_iter()
        .find(|svc| svc.vip == data_addr)
    {
        return Err(Problem::invalid(
            "data_addr",
            format!(
                "{data_addr} is the address of service {:?} ({data_addr}:{}); a server needs an address of its own",
                svc.name, svc.port
            ),
        ));
    }
    let id = match b.id {
        Some(id) => {
            if existing.iter().any(|s| s.id.0 as u64 == id) {
                return Err(Problem::conflict(format!(
                    "server id {id} is already registered"
                )));
            }
            ServerId(id as u32)
        }
        None => {
            let max = existing.iter().map(|s| s.id.0).max().unwrap_or(0);
            if max == u32::MAX {
                return Err(Problem::conflict(
                    "no free server id above the largest one; pass `id`",
                ));
            }
            ServerId(max + 1)
        }
    };
    let mut server = Server::new(id, b.name, mgmt, data_addr);
    server.weight = weight;
    // An explicit weight is the operator's: a REGISTER keeps it.
    server.weight_set = b.weight.is_some();
    state.store.put_server(&server).await?;
    drop(_g);
    audit(
        state,
        &who,
        "server.register",
        format!("servers/{}", id.0),
        body,
    )
    .await;
    let view = server_view(state, server, None).await?;
    Ok(HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/v1/servers/{}", id.0)))
        .content_type("application/json")
        .body(serde_json::to_string(&view).unwrap_or_default()))
}

async fn deregister_server(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    let s = existing_server(state, &path).await?;
    let shown = crate::control::server_shown_state(state.store.as_ref(), &s).await?;
    if !matches!(shown, ServerState::Drained | ServerState::Dead) {
        return Err(Problem::conflict(format!(
            "server {} is {}; drain it (or wait until it is dead) before deregistering",
            s.id.0,
            shown.as_str()
        )));
    }
    let _g = state.write_lock.lock().await;
    if let Some(svc) = state
        .store
        .list_services()
        .await?
        .into_iter()
        .find(|svc| svc.pool.contains(&s.id))
    {
        return Err(Problem::conflict(format!(
            "server {} is in the pool of service {:?}; remove it there first",
            s.id.0, svc.name
        )));
    }
    state.store.delete_drain(s.id).await?;
    state.store.delete_server(s.id).await?;
    drop(_g);
    audit(
        state,
        &who,
        "server.deregister",
        format!("servers/{}", s.id.0),
        json!({ "name": s.name }),
    )
    .await;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightBody {
    weight: u64,
}

async fn set_weight(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let s = existing_server(state, &path).await?;
    let b: WeightBody = parse_body(read_json(&req, payload, true).await?.unwrap_or(Value::Null))?;
    let w = check_weight("weight", b.weight)?;
    let updated = state.store.set_server_weight(s.id, w).await?;
    audit(
        state,
        &who,
        "server.weight",
        format!("servers/{}", s.id.0),
        json!({ "old": s.weight, "new": w }),
    )
    .await;
    Ok(ok(&server_view(state, updated, None).await?))
}

/// Clears the operator's weight: the REGISTER's applies again.
async fn clear_weight(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let s = existing_server(state, &path).await?;
    let updated = state.store.clear_server_weight(s.id).await?;
    audit(
        state,
        &who,
        "server.weight.clear",
        format!("servers/{}", s.id.0),
        json!({ "old": s.weight, "operator": s.weight_set, "new": updated.weight }),
    )
    .await;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    deadline_seconds: Option<u64>,
    mode: Option<DrainMode>,
    targets: Option<Vec<u64>>,
}

async fn drain_server(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let s = existing_server(state, &path).await?;
    // Every field is optional: no body (`curl -X POST`, no Content-Type)
    // is `{}`, the defaults.
    let body = read_json(&req, payload, false)
        .await?
        .unwrap_or_else(|| json!({}));
    let b: DrainBody = parse_body(body.clone())?;
    let deadline = b.deadline_seconds.unwrap_or(30);
    if !(1..=86_400).contains(&deadline) {
        return Err(Problem::invalid(
            "deadline_seconds",
            format!("must be in [1, 86400], got {deadline}"),
        ));
    }
    let mut targets = Vec::new();
    for (i, t) in b.targets.unwrap_or_default().into_iter().enumerate() {
        if !(1..=u32::MAX as u64).contains(&t) {
            return Err(Problem::invalid(
                format!("targets[{i}]"),
                format!("must be a server id in [1, 4294967295], got {t}"),
            ));
        }
        if targets.contains(&ServerId(t as u32)) {
            return Err(Problem::invalid(
                format!("targets[{i}]"),
                format!("server {t} is listed twice"),
            ));
        }
        targets.push(ServerId(t as u32));
    }
    if targets.len() > 1024 {
        return Err(Problem::invalid("targets", "at most 1024 targets"));
    }
    let spec = DrainSpec {
        deadline: Duration::from_secs(deadline),
        mode: b.mode.unwrap_or(DrainMode::Migrate),
        targets,
    };
    // Automation retries drains: a drain the server already has is answered
    // with its record (200) instead of being replaced by a new one, which
    // would lose the finished drain's progress or reset a running deadline.
    // A drained server that holds connections again has work for a new one.
    if let Some(d) = state.cp.drain_status(s.id).await? {
        match d.state {
            DrainState::Completed if state.store.list_flows_by_server(s.id).await?.is_empty() => {
                return Ok(ok(&d))
            }
            DrainState::Running => {
                if let Some(diff) = running_drain_differs(&d, &spec) {
                    let left_s = d
                        .deadline_unix_ms
                        .saturating_sub(capybara_store::unix_ms_now())
                        .div_ceil(1000);
                    return Err(Problem::conflict(format!(
                        "server {} is already draining (deadline in {left_s} s) with {diff}; undrain it first to start another drain",
                        s.id.0
                    )));
                }
                return Ok(ok(&d));
            }
            _ => {}
        }
    }
    let view = state.cp.start_drain(s.id, spec).await?;
    audit(
        state,
        &who,
        "server.drain",
        format!("servers/{}", s.id.0),
        body,
    )
    .await;
    Ok(json_response(actix_web::http::StatusCode::ACCEPTED, &view))
}

/// What a drain request asks that differs from the running drain `d`, in
/// words (`None`: the same drain, a retry).
fn running_drain_differs(d: &DrainView, spec: &DrainSpec) -> Option<String> {
    let mut diffs = Vec::new();
    if d.mode != spec.mode {
        diffs.push(format!(
            "mode {} (not {})",
            d.mode.as_str(),
            spec.mode.as_str()
        ));
    }
    let running_s = d.deadline_unix_ms.saturating_sub(d.started_unix_ms) / 1000;
    if running_s != spec.deadline.as_secs() {
        diffs.push(format!(
            "deadline_seconds {running_s} (not {})",
            spec.deadline.as_secs()
        ));
    }
    let mut running_targets = d.targets.clone();
    running_targets.sort_unstable();
    let mut asked: Vec<u32> = spec.targets.iter().map(|t| t.0).collect();
    asked.sort_unstable();
    if running_targets != asked {
        diffs.push(format!("targets {running_targets:?} (not {asked:?})"));
    }
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

async fn get_drain(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let s = existing_server(state, &path).await?;
    match state.cp.drain_status(s.id).await? {
        Some(d) => Ok(ok(&d)),
        None => Err(Problem::not_found(format!(
            "server {} has never been drained",
            s.id.0
        ))),
    }
}

async fn undrain_server(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let s = existing_server(state, &path).await?;
    let previous = crate::control::server_shown_state(state.store.as_ref(), &s).await?;
    state.cp.stop_drain(s.id).await?;
    audit(
        state,
        &who,
        "server.undrain",
        format!("servers/{}", s.id.0),
        json!({ "previous_state": previous.as_str() }),
    )
    .await;
    let s = existing_server(state, &path).await?;
    Ok(ok(&server_view(state, s, None).await?))
}

// ----- services

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceBody {
    name: Option<String>,
    vip: String,
    port: u64,
    pool: Vec<u64>,
}

#[derive(Serialize)]
struct ServiceView {
    name: String,
    vip: String,
    port: u16,
    pool: Vec<u32>,
    /// switchd's view (`GET` only; absent without switchd).
    #[serde(skip_serializing_if = "Option::is_none")]
    serving: Option<ServiceServing>,
}

fn service_view(s: &Service) -> ServiceView {
    ServiceView {
        name: s.name.clone(),
        vip: s.vip.to_string(),
        port: s.port,
        pool: s.pool.iter().map(|p| p.0).collect(),
        serving: None,
    }
}

/// A stored service with switchd's view of it (`serving`), when switchd
/// answered: applied (a VIP:port it serves), refused (with its reason),
/// or pending (not read yet). See [`ServicesStatus::view_of`].
fn serving_view(s: &Service, status: Option<&ServicesStatus>) -> ServiceView {
    let mut v = service_view(s);
    v.serving = status.map(|st| st.view_of(s));
    v
}

/// Services the data plane can serve at once (switchd's `MAX_SERVICES`).
const MAX_SERVICES: usize = 16;

/// Validates a service body against the registered servers and the other
/// services (unique VIP:port).
async fn check_service(state: &AppState, name: String, b: ServiceBody) -> ApiResult<Service> {
    let vip: Ipv4Addr = b.vip.parse().map_err(|_| {
        Problem::invalid("vip", format!("must be an IPv4 address, got {:?}", b.vip))
    })?;
    // What switchd's config refuses for a service (`services[i].vip`):
    // no client connects to such an address.
    if vip.is_unspecified() || vip.is_broadcast() || vip.is_multicast() {
        return Err(Problem::invalid(
            "vip",
            format!("must be a unicast address, got {vip}"),
        ));
    }
    if vip.is_loopback() {
        return Err(Problem::invalid(
            "vip",
            format!("must be an address clients reach through the switch, got loopback {vip}"),
        ));
    }
    if let Some(what) = switch_addr(state, vip) {
        return Err(Problem::invalid(
            "vip",
            format!(
                "{vip} is the switch's own address ({what}); a service needs an address of its own"
            ),
        ));
    }
    if !(1..=65535).contains(&b.port) {
        return Err(Problem::invalid(
            "port",
            format!("must be in [1, 65535], got {}", b.port),
        ));
    }
    if b.pool.len() > 1024 {
        return Err(Problem::invalid("pool", "at most 1024 servers"));
    }
    let registered = state.store.list_servers().await?;
    // switchd forwards a server's connections to its data address: a
    // service there would take that server's traffic for itself.
    if let Some(s) = registered.iter().find(|s| s.data_addr == vip) {
        return Err(Problem::invalid(
            "vip",
            format!(
                "{vip} is the data address of server {} ({:?}); a service needs an address of its own",
                s.id.0, s.name
            ),
        ));
    }
    let servers: HashSet<u32> = registered.iter().map(|s| s.id.0).collect();
    let mut pool = Vec::new();
    for (i, id) in b.pool.iter().enumerate() {
        let f = format!("pool[{i}]");
        if !(1..=u32::MAX as u64).contains(id) {
            return Err(Problem::invalid(
                f,
                format!("must be a server id in [1, 4294967295], got {id}"),
            ));
        }
        if !servers.contains(&(*id as u32)) {
            return Err(Problem::invalid(
                f,
                format!("server {id} is not registered"),
            ));
        }
        if pool.contains(&ServerId(*id as u32)) {
            return Err(Problem::invalid(f, format!("server {id} is listed twice")));
        }
        pool.push(ServerId(*id as u32));
    }
    if let Some(other) = state
        .store
        .list_services()
        .await?
        .into_iter()
        .find(|s| s.vip == vip && s.port == b.port as u16 && s.name != name)
    {
        return Err(Problem::conflict(format!(
            "{vip}:{} is already the address of service {:?}",
            b.port, other.name
        )));
    }
    Ok(Service {
        name,
        vip,
        port: b.port as u16,
        pool,
    })
}

fn check_service_name(raw: &str) -> ApiResult<()> {
    if valid_name(raw) {
        Ok(())
    } else {
        Err(Problem::bad_param(
            "service_name",
            "service names are 1-64 characters of [A-Za-z0-9_.-]",
        ))
    }
}

async fn list_services(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let services = state.store.list_services().await?;
    // One switchd `/status` for both: what it serves, and the deleted
    // services it still serves connections of (absent when it does not
    // answer).
    let status = state.cp.services_status().await;
    let items: Vec<_> = services
        .iter()
        .map(|s| serving_view(s, status.as_ref()))
        .collect();
    let mut body = json!({ "items": items });
    if let Some(retiring) = status.and_then(|s| s.retiring) {
        body["retiring"] = json!(retiring);
    }
    Ok(ok(&body))
}

async fn create_service(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    let body = read_json(&req, payload, true).await?.unwrap_or(Value::Null);
    let b: ServiceBody = parse_body(body.clone())?;
    let Some(name) = b.name.clone() else {
        return Err(Problem::invalid("name", "missing field `name`"));
    };
    if !valid_name(&name) {
        return Err(Problem::invalid(
            "name",
            "must be 1-64 characters of [A-Za-z0-9_.-]",
        ));
    }
    let _g = state.write_lock.lock().await;
    let svc = check_service(state, name.clone(), b).await?;
    if state.store.get_service(&name).await?.is_some() {
        return Err(Problem::conflict(format!(
            "service {name:?} already exists"
        )));
    }
    if state.store.list_services().await?.len() >= MAX_SERVICES {
        return Err(Problem::conflict(format!(
            "at most {MAX_SERVICES} services can be served (the data plane's service slots); delete one first"
        )));
    }
    state.store.put_service(&svc).await?;
    drop(_g);
    audit(
        state,
        &who,
        "service.create",
        format!("services/{name}"),
        body,
    )
    .await;
    Ok(HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/v1/services/{name}")))
        .content_type("application/json")
        .body(serde_json::to_string(&service_view(&svc)).unwrap_or_default()))
}

async fn get_service(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    check_service_name(&path)?;
    match state.store.get_service(&path).await? {
        Some(s) => {
            let status = state.cp.services_status().await;
            Ok(ok(&serving_view(&s, status.as_ref())))
        }
        None => Err(Problem::not_found(format!(
            "service {:?} not found",
            path.as_str()
        ))),
    }
}

async fn update_service(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    check_service_name(&path)?;
    let name = path.into_inner();
    let body = read_json(&req, payload, true).await?.unwrap_or(Value::Null);
    if body.get("name").is_some() {
        return Err(Problem::invalid(
            "name",
            "unknown field `name`: the name is in the path and cannot change",
        ));
    }
    let b: ServiceBody = parse_body(body.clone())?;
    let _g = state.write_lock.lock().await;
    let Some(old) = state.store.get_service(&name).await? else {
        return Err(Problem::not_found(format!("service {name:?} not found")));
    };
    let svc = check_service(state, name.clone(), b).await?;
    state.store.put_service(&svc).await?;
    drop(_g);
    audit(
        state,
        &who,
        "service.update",
        format!("services/{name}"),
        json!({ "old": service_view(&old), "new": body }),
    )
    .await;
    Ok(ok(&service_view(&svc)))
}

async fn delete_service(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    check_service_name(&path)?;
    if !state.store.delete_service(&path).await? {
        return Err(Problem::not_found(format!(
            "service {:?} not found",
            path.as_str()
        )));
    }
    audit(
        state,
        &who,
        "service.delete",
        format!("services/{}", path.as_str()),
        json!({}),
    )
    .await;
    Ok(HttpResponse::NoContent().finish())
}

// ----- connections and migrations

async fn list_connections(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let q = Query::parse(&req)?;
    let server = q
        .u64_in("server", 1, u32::MAX as u64)?
        .map(|s| ServerId(s as u32));
    let limit = q.u64_in("limit", 1, 10_000)?.unwrap_or(100) as usize;
    // Read from switchd's /status only when needed (a filter by service,
    // a connection of no live service).
    let mut retiring: Option<Vec<((Ipv4Addr, u16), String)>> = None;
    let service = match q.get("service") {
        None => None,
        Some(name) => {
            if !valid_name(name) {
                return Err(Problem::bad_param(
                    "service",
                    "service names are 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            // Its address, and those switchd still retires for it (deleted,
            // or its VIP or port changed: their open connections go on).
            let mut addrs: Vec<(Ipv4Addr, u16)> = retiring
                .get_or_insert(retiring_addresses(state).await)
                .iter()
                .filter(|(_, n)| n == name)
                .map(|(a, _)| *a)
                .collect();
            if let Some(s) = state.store.get_service(name).await? {
                addrs.push((s.vip, s.port));
            }
            if addrs.is_empty() {
                // A typo must not look like "no connections".
                return Err(Problem::not_found(format!(
                    "service {name:?} not found (`GET /v1/services` lists them)"
                ))
                .with_field("service"));
            }
            Some(addrs)
        }
    };
    let mut page = state
        .cp
        .connections(&ConnectionFilter {
            server,
            service,
            limit,
        })
        .await?;
    // A connection of a retiring address is its old service's.
    if page.items.iter().any(|c| c.service.is_none()) {
        let retiring = match retiring {
            Some(r) => r,
            None => retiring_addresses(state).await,
        };
        for c in page.items.iter_mut().filter(|c| c.service.is_none()) {
            let addr = (c.vip.parse().unwrap_or(Ipv4Addr::UNSPECIFIED), c.port);
            c.service = retiring
                .iter()
                .find(|(a, _)| *a == addr)
                .map(|(_, n)| n.clone());
        }
    }
    // An unregistered server owns no connection, unless it was deregistered
    // dead while switchd still keeps its connections (`dead_flow_grace_ms`):
    // those are listed.
    if let Some(id) = server {
        if page.total == 0 && state.store.get_server(id).await?.is_none() {
            return Err(Problem::not_found(format!(
                "server {} not found (`GET /v1/servers` lists them)",
                id.0
            ))
            .with_field("server"));
        }
    }
    Ok(ok(&page))
}

/// The addresses switchd still retires, with the name of the service they
/// were (none without switchd, or when it does not answer).
async fn retiring_addresses(state: &AppState) -> Vec<((Ipv4Addr, u16), String)> {
    state
        .cp
        .services_status()
        .await
        .and_then(|st| st.retiring)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|r| Some(((r.vip.parse().ok()?, r.port), r.name)))
        .collect()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrateBody {
    target: Option<u64>,
}

async fn migrate_connection(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let body = read_json(&req, payload, false).await?;
    let target = match &body {
        Some(v) => {
            let b: MigrateBody = parse_body(v.clone())?;
            match b.target {
                Some(t) if !(1..=u32::MAX as u64).contains(&t) => {
                    return Err(Problem::invalid(
                        "target",
                        format!("must be a server id in [1, 4294967295], got {t}"),
                    ))
                }
                t => t.map(|t| ServerId(t as u32)),
            }
        }
        None => None,
    };
    let Some(key) = parse_connection_id(&path) else {
        return Err(Problem::not_found(format!(
            "connection {:?} not found (ids are CLIENT_IP:PORT-VIP:PORT)",
            path.as_str()
        )));
    };
    let m = state.cp.migrate(key, target).await?;
    audit(
        state,
        &who,
        "connection.migrate",
        format!("connections/{}", path.as_str()),
        json!({ "target": target.map(|t| t.0), "migration": m.id }),
    )
    .await;
    Ok(json_response(actix_web::http::StatusCode::ACCEPTED, &m))
}

async fn list_migrations(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let q = Query::parse(&req)?;
    let after = q.u64_in("after", 0, i64::MAX as u64)?.unwrap_or(0);
    let limit = q.u64_in("limit", 1, 10_000)?.unwrap_or(100) as usize;
    let newest_first = q.newest_first()?;
    let items = if newest_first {
        // The control plane lists oldest first from `after`; its log is
        // bounded (switchd's: the last 1000), so the newest are its tail.
        let mut all = state.cp.recent_migrations(after, usize::MAX).await?;
        all.drain(..all.len().saturating_sub(limit));
        all.reverse();
        all
    } else {
        state.cp.recent_migrations(after, limit).await?
    };
    Ok(ok(
        &json!({ "items": items, "data_source": state.cp.data_source() }),
    ))
}

// ----- policy

const POLICY_FIELDS: [&str; 14] = [
    "proactive_enabled",
    "proactive_threshold_pct",
    "reactive_enabled",
    "reactive_backlog_threshold",
    "target_selection",
    "placement",
    "connection_cooldown_ms",
    "max_migrations_per_sec_per_server",
    "hysteresis_pct",
    "load_notification_interval_us",
    "heartbeat_interval_ms",
    "dead_after_ms",
    "migration_deadline_ms",
    "buffer_mode",
];

/// Applies `changes` (every key, for PUT) to `current` and validates the
/// result; the 422 names the first bad field.
fn merge_policy(current: &Policy, changes: Value, full: bool) -> ApiResult<Policy> {
    let Value::Object(changes) = changes else {
        return Err(Problem::invalid("body", "must be a JSON object"));
    };
    for k in changes.keys() {
        if !POLICY_FIELDS.contains(&k.as_str()) {
            return Err(Problem::invalid(k.clone(), format!("unknown field `{k}`")));
        }
    }
    if full {
        if let Some(missing) = POLICY_FIELDS.iter().find(|f| !changes.contains_key(**f)) {
            return Err(Problem::invalid(
                *missing,
                "is required (use PATCH to change some fields)",
            ));
        }
    }
    let mut merged = serde_json::to_value(current).map_err(|e| Problem::internal(e.to_string()))?;
    for (k, v) in changes {
        merged[&k] = v;
    }
    let p: Policy = parse_body(merged)?;
    if p.hysteresis_pct > 1000.0 {
        return Err(Problem::invalid("hysteresis_pct", "must be at most 1000"));
    }
    p.validate()
        .map_err(|e| Problem::invalid(e.field, e.reason))?;
    Ok(p)
}

async fn get_policy(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    Ok(ok(&state.store.get_policy().await?))
}

async fn write_policy(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
    full: bool,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Operator, false)?;
    let body = read_json(&req, payload, true).await?.unwrap_or(Value::Null);
    let _g = state.write_lock.lock().await;
    let old = state.store.get_policy().await?;
    let new = merge_policy(&old, body, full)?;
    state.store.put_policy(&new).await?;
    drop(_g);
    let (ov, nv) = (
        serde_json::to_value(&old).unwrap_or_default(),
        serde_json::to_value(&new).unwrap_or_default(),
    );
    let changed: BTreeMap<&str, Value> = POLICY_FIELDS
        .iter()
        .filter(|f| ov.get(**f) != nv.get(**f))
        .map(|f| (*f, json!({ "old": ov.get(*f), "new": nv.get(*f) })))
        .collect();
    audit(
        state,
        &who,
        if full {
            "policy.replace"
        } else {
            "policy.update"
        },
        "policy".into(),
        json!({ "changed": changed }),
    )
    .await;
    Ok(ok(&new))
}

async fn put_policy(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    write_policy(req, payload, data, true).await
}

async fn patch_policy(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    write_policy(req, payload, data, false).await
}

// ----- tokens

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    name: String,
    role: Role,
}

fn db_problem(e: ApiDbError) -> Problem {
    match e {
        ApiDbError::DuplicateName(_) | ApiDbError::LastAdmin => Problem::conflict(e.to_string()),
        ApiDbError::NotFound(_) => Problem::not_found(e.to_string()),
        other => {
            tracing::error!(error = %other, "API database error");
            Problem::internal(other.to_string())
        }
    }
}

/// Any valid token may ask who it is (the dashboard hides what it may not do).
async fn whoami(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let who = authorize(&req, st(&data), Role::Viewer, false)?;
    Ok(ok(&who.token))
}

async fn list_tokens(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Admin, false)?;
    Ok(ok(
        &json!({ "items": state.db.list().map_err(db_problem)? }),
    ))
}

async fn create_token(
    req: HttpRequest,
    payload: web::Payload,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    let b: TokenBody = parse_body(read_json(&req, payload, true).await?.unwrap_or(Value::Null))?;
    if !valid_name(&b.name) {
        return Err(Problem::invalid(
            "name",
            "must be 1-64 characters of [A-Za-z0-9_.-]",
        ));
    }
    let (info, secret) = state
        .db
        .create(&b.name, b.role, &who.token.name)
        .map_err(db_problem)?;
    audit(
        state,
        &who,
        "token.create",
        format!("tokens/{}", info.id),
        json!({ "name": info.name, "role": info.role }),
    )
    .await;
    let mut v = serde_json::to_value(&info).unwrap_or_default();
    v["secret"] = json!(secret);
    Ok(json_response(actix_web::http::StatusCode::CREATED, &v))
}

async fn revoke_token(
    req: HttpRequest,
    path: web::Path<String>,
    data: web::Data<AppState>,
) -> ApiResult<HttpResponse> {
    let state = st(&data);
    let who = authorize(&req, state, Role::Admin, false)?;
    let id = path.into_inner();
    if !(id.len() == 18
        && id.starts_with("t_")
        && id[2..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    {
        return Err(Problem::bad_param(
            "token_id",
            "token ids are `t_` followed by 16 hex digits",
        ));
    }
    if id == who.token.id {
        // Nobody locks themselves out by accident (or by fuzzing).
        return Err(Problem::conflict(
            "a token cannot revoke itself; use another admin token",
        ));
    }
    let info = state.db.revoke(&id).map_err(db_problem)?;
    audit(
        state,
        &who,
        "token.revoke",
        format!("tokens/{id}"),
        json!({ "name": info.name }),
    )
    .await;
    Ok(HttpResponse::NoContent().finish())
}

// ----- audit, health

async fn list_audit(req: HttpRequest, data: web::Data<AppState>) -> ApiResult<HttpResponse> {
    let state = st(&data);
    authorize(&req, state, Role::Viewer, false)?;
    let q = Query::parse(&req)?;
    let after = q.u64_in("after", 0, i64::MAX as u64)?.unwrap_or(0);
    let limit = q.u64_in("limit", 1, 10_000)?.unwrap_or(100) as usize;
    let newest_first = q.newest_first()?;
    let entries = if newest_first {
        state.store.list_audit_newest(after, limit).await?
    } else {
        state.store.list_audit(after, limit).await?
    };
    let next = entries.iter().map(|e| e.seq).max().unwrap_or(after);
    let items: Vec<Value> = entries
        .into_iter()
        .map(|e| {
            let detail = if e.record.detail.is_object() { e.record.detail } else { json!({ "value": e.record.detail }) };
            json!({ "seq": e.seq, "at_unix_ms": e.at_unix_ms, "actor": e.record.actor, "action": e.record.action,
                    "target": e.record.target, "detail": detail })
        })
        .collect();
    Ok(ok(&json!({ "items": items, "next_after": next })))
}

async fn healthz(data: web::Data<AppState>) -> HttpResponse {
    ok(&json!({ "status": "ok", "store": data.store.backend(), "control_plane": data.cp.name() }))
}

/// 200 or 503 as the store answers (only the store: the API serves reads
/// from it while switchd is down). The 200 body also says whether switchd's
/// control endpoint answered, probed at the same time as the store and for
/// at most `SWITCHD_PROBE`, so that the answer stays well within a second
/// when switchd is down.
async fn readyz(data: web::Data<AppState>) -> HttpResponse {
    const SWITCHD_PROBE: Duration = Duration::from_millis(500);
    let store = async {
        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(2), data.store.get_policy()).await;
        (r, started.elapsed())
    };
    let ((store, took), switchd) = tokio::join!(store, data.cp.probe_switchd(SWITCHD_PROBE));
    match store {
        Ok(Ok(_)) => {
            data.metrics.record_store_probe(Some(took));
            let mut body = json!({ "status": "ok", "store": data.store.backend(),
                                   "control_plane": data.cp.name() });
            match switchd {
                None => body["switchd"] = json!("not_configured"),
                Some(Ok(())) => body["switchd"] = json!("reachable"),
                Some(Err(p)) => {
                    body["switchd"] = json!("unreachable");
                    body["switchd_error"] = json!(p.detail);
                }
            }
            ok(&body)
        }
        Ok(Err(e)) => Problem::unavailable(format!("store not ready: {e}")).error_response(),
        Err(_) => Problem::unavailable("store did not answer within 2 s").error_response(),
    }
}

/// For `events`: a server as the `server` event carries it.
pub async fn server_event(
    state: &AppState,
    id: ServerId,
    stats: &HashMap<ServerId, ServerStats>,
) -> ApiResult<Value> {
    let server = match state.store.get_server(id).await? {
        Some(s) => Some(
            server_view(
                state,
                s,
                stats.get(&id).copied().or(Some(ServerStats {
                    data_source: state.cp.data_source(),
                    connections: 0,
                    load_pps: None,
                    apps_down: None,
                    live: None,
                })),
            )
            .await?,
        ),
        None => None,
    };
    Ok(json!({ "id": id.0, "server": server }))
}

pub(crate) fn service_event(name: &str, s: Option<&Service>) -> Value {
    json!({ "name": name, "service": s.map(service_view) })
}

pub(crate) fn data_source_json(d: DataSource) -> Value {
    serde_json::to_value(d).unwrap_or(Value::Null)
}

/// Total of request counters, by status class (for tests and metrics).
pub fn requests_total(m: &Metrics) -> u64 {
    m.requests
        .iter()
        .map(|c: &AtomicU64| c.load(Ordering::Relaxed))
        .sum()
}
