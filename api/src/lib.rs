//! The operators' REST API and the dashboard it serves.
//!
//! `api` owns `openapi.yaml`, the single source of truth of the REST contract
//! (servers, services, connections, migrations, drains, policies, events,
//! metrics, health), the actix-web server that implements it, bearer-token
//! authentication with roles, and the clients generated from the spec. The
//! static assets of `web-ui/` are built into it and served at `/`.
