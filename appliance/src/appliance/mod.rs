//! `capybara run CONFIG`: switchd, the REST API and the dashboard in one
//! process, from one config file ([`config`]).
//!
//! Lifecycle: SIGTERM/SIGINT (or either component stopping) is a graceful
//! stop of both. switchd runs its daemon on its own thread and on stop
//! detaches its programs, flushes pending flow mappings to the store (the
//! batching writer is closed, not dropped) and resigns the leader lease; the
//! API finishes in-flight requests. Flow mappings therefore survive a
//! restart (the restarted switchd restores them from the store, as a standby
//! does on takeover).

pub mod active;
pub mod config;
pub mod own_addrs;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use capybara_api::switchd::SwitchdControlPlane;
use capybara_api::{ApiConfig, ApiDb, StoreControlPlane};
use capybara_switchd::daemon;

use config::{ApiSettings, ApplianceConfig};

/// Runs until SIGTERM/SIGINT; the error of whichever component failed.
pub fn run(cfg: ApplianceConfig) -> anyhow::Result<()> {
    daemon::install_shutdown_signals();
    if let Err(e) = std::fs::create_dir_all(&cfg.state_dir) {
        anyhow::bail!("cannot create state_dir {}: {e}", cfg.state_dir.display());
    }
    eprintln!("capybara: starting: {}", cfg.summary());

    // switchd and the API each open the store; two first opens of a new
    // SQLite file at once would both create its schema. Opening it here
    // first leaves them an up-to-date file.
    if matches!(cfg.store, config::StoreChoice::Sqlite(_)) && cfg.switchd.is_some() {
        actix_web::rt::System::new()
            .block_on(capybara_store::open(&cfg.store.store_config()))
            .with_context(|| format!("opening store {}", cfg.store))?;
    }

    let switchd = cfg.switchd.clone().map(|sw| {
        std::thread::Builder::new()
            .name("switchd".into())
            .spawn(move || {
                let r = daemon::run(sw);
                // Whatever ended switchd ends the appliance.
                daemon::request_shutdown();
                r
            })
            .expect("spawning the switchd thread")
    });

    let api_result = match &cfg.api {
        Some(api) => actix_web::rt::System::new().block_on(run_api(&cfg, api)),
        None => {
            while !daemon::shutdown_requested() {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        }
    };
    // The API failed to start or stopped: stop switchd too.
    daemon::request_shutdown();
    let switchd_result = match switchd {
        Some(h) => h
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the switchd thread panicked"))),
        None => Ok(()),
    };
    eprintln!("capybara: stopped");
    api_result.context("api")?;
    switchd_result.context("switchd")
}

async fn run_api(cfg: &ApplianceConfig, api: &ApiSettings) -> anyhow::Result<()> {
    let store = capybara_store::open(&cfg.store.store_config())
        .await
        .with_context(|| format!("opening store {}", cfg.store))?;
    let db = Arc::new(
        ApiDb::open(&api.db).with_context(|| format!("opening api.db {}", api.db.display()))?,
    );
    // A token file keeps the first admin token whatever happens next, and
    // is there once the API answers (scripts wait for /healthz, then read
    // it). Without one, the token is shown once, so only once listening.
    if let Some(f) = &api.admin_token_file {
        if db.bootstrap_admin(Some(f))?.is_some() {
            eprintln!("capybara: admin token written to {}", f.display());
        }
    }
    // The problem's detail (e.g. `store error: SQLite store PATH: file is
    // corrupt ...`), without the HTTP status and title that only mean
    // something in a response.
    let cp = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .map_err(|p| anyhow::anyhow!("{}", p.detail))?;
    let control_plane: Arc<dyn capybara_api::ControlPlane> = match api.switchd.len() {
        0 => Arc::new(cp),
        1 => Arc::new(
            SwitchdControlPlane::new(cp, store.clone(), &api.switchd[0])
                .map_err(|p| anyhow::anyhow!("api.switchd {}: {}", api.switchd[0], p.detail))?,
        ),
        _ => {
            // One id counter: migration ids go on increasing across takeovers.
            let ids = capybara_api::switchd::MigrationIds::default();
            let mut planes = Vec::new();
            for url in &api.switchd {
                planes.push(
                    SwitchdControlPlane::with_migration_ids(
                        cp.clone(),
                        store.clone(),
                        url,
                        ids.clone(),
                    )
                    .map_err(|p| anyhow::anyhow!("api.switchd {url}: {}", p.detail))?,
                );
            }
            Arc::new(active::ActiveSwitchd::new(planes))
        }
    };
    let mut running = capybara_api::start(ApiConfig {
        listen: api.listen,
        store,
        control_plane,
        db: db.clone(),
        static_dir: api.static_dir.clone(),
        workers: api.workers,
        switch_addrs: own_addrs::switch_addrs(cfg, api),
    })
    .await
    .with_context(|| format!("binding api.listen {}", api.listen))?;
    if api.admin_token_file.is_none() {
        running = running.show_first_admin_token(&db).await?;
    }
    println!("capybara: api listening on http://{}", running.addr);
    use std::io::Write;
    std::io::stdout().flush().ok();
    while !daemon::shutdown_requested() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("capybara: shutting down");
    running.stop().await;
    Ok(())
}
