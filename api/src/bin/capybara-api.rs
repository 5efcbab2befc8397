//! Development and test server: `capybara-api --store sqlite:PATH`.
//!
//! Prints `listening on http://ADDR` once bound (tests read it to learn the
//! port when `--listen 127.0.0.1:0`), and a freshly created admin token once.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use capybara_api::switchd::SwitchdControlPlane;
use capybara_api::{ApiConfig, ApiDb, StoreControlPlane};
use capybara_store::{SqliteConfig, SqliteStore, Store};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "capybara-api",
    about = "Capybara operators' REST API (development server)"
)]
struct Args {
    /// Store to open: `sqlite:PATH`.
    #[arg(long, default_value = "sqlite:capybara.db")]
    store: String,
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// The API's token database (default: the store path + `.api`).
    #[arg(long)]
    api_db: Option<PathBuf>,
    /// Admin token file: read (or created with a new token) at start.
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Dashboard assets served at `/`.
    #[arg(long)]
    static_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// switchd's HTTP endpoint (e.g. `http://127.0.0.1:9102`): live load,
    /// drains and migrations through the running switch. Without it the
    /// API works from the store alone.
    #[arg(long, value_name = "URL")]
    switchd: Option<String>,
    /// One of the switch's own addresses (e.g. its `control_listen` IP),
    /// refused as a service VIP or a server data address; repeatable.
    #[arg(long, value_name = "IPV4")]
    switch_addr: Vec<std::net::Ipv4Addr>,
}

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let Some(path) = args.store.strip_prefix("sqlite:") else {
        bail!("--store must be sqlite:PATH, got {:?}", args.store);
    };
    let path = PathBuf::from(path);
    let store: Arc<dyn Store> = Arc::new(
        SqliteStore::open(SqliteConfig {
            path: path.clone(),
            ..SqliteConfig::default()
        })
        .await
        .with_context(|| format!("opening store {}", path.display()))?,
    );
    let api_db_path = args.api_db.unwrap_or_else(|| {
        let mut p = path.clone().into_os_string();
        p.push(".api");
        PathBuf::from(p)
    });
    let db = Arc::new(ApiDb::open(&api_db_path)?);
    // A token file keeps the first admin token whatever happens next, and
    // is there once the API answers (scripts wait for /healthz, then read
    // it). Without one, the token is shown once, so only once listening.
    if let Some(f) = &args.admin_token_file {
        if db.bootstrap_admin(Some(f))?.is_some() {
            eprintln!("admin token written to {}", f.display());
        }
    }
    let cp = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .map_err(|p| anyhow::anyhow!("{p}"))?;
    let control_plane: Arc<dyn capybara_api::ControlPlane> = match &args.switchd {
        Some(url) => Arc::new(
            SwitchdControlPlane::new(cp, store.clone(), url)
                .map_err(|p| anyhow::anyhow!("--switchd {url}: {}", p.detail))?,
        ),
        None => Arc::new(cp),
    };
    let mut running = capybara_api::start(ApiConfig {
        listen: args.listen,
        store,
        control_plane,
        db: db.clone(),
        static_dir: args.static_dir,
        workers: args.workers,
        switch_addrs: capybara_api::server::fixed_switch_addrs(
            args.switch_addr
                .iter()
                .map(|a| (*a, "--switch-addr".to_string()))
                .collect(),
        ),
    })
    .await
    .with_context(|| format!("binding {}", args.listen))?;
    if args.admin_token_file.is_none() {
        running = running.show_first_admin_token(&db).await?;
    }
    println!("listening on http://{}", running.addr);
    use std::io::Write;
    std::io::stdout().flush().ok();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("shutting down");
    running.stop().await;
    Ok(())
}
