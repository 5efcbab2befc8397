//! The operators' REST API and the dashboard it serves.
//!
//! `api` owns `openapi.yaml`, the single source of truth of the REST contract
//! (servers, services, connections, migrations, drains, policies, tokens,
//! events, audit, metrics, health), the actix-web server that implements it,
//! bearer-token authentication with roles, the clients generated from the
//! spec (`clients/`) and the `capybara ctl` command line (`ctl`). The static
//! assets of `web-ui/` are served at `/`.
//!
//! Live operations go through the `control::ControlPlane` trait. This crate
//! ships `control::StoreControlPlane`, which works from the store alone (no
//! live load, no migrations); the appliance wires the switchd one.
//!
//! Invariants: bad input never yields a 5xx; every error is an RFC 9457
//! problem; every successful mutation is appended to the audit log with the
//! token name; all durable state is in the store (plus the API's own token
//! database), so a restart of the API loses nothing.

pub mod apidb;
pub mod auth;
pub mod control;
pub mod ctl;
pub mod events;
pub mod metrics;
pub mod problem;
pub mod server;
pub mod switchd;

pub use apidb::{ApiDb, DrainMode, Role};
pub use control::{ControlPlane, StoreControlPlane};
pub use server::{start, ApiConfig, RunningApi};

/// The contract, embedded so the server and tools can serve or check it.
pub const OPENAPI_YAML: &str = include_str!("../openapi.yaml");
