//! Durable state of the appliance behind one `Store` trait.
//!
//! `store` owns servers, services, policies, flow-to-server mappings, drains,
//! the audit log, leader election for switchd HA and change notification.
//! Two backends behave identically and are checked by one conformance suite:
//! embedded SQLite (the default, one file) and etcd v3 (clusters). Writes from
//! the packet path go through a bounded, batching writer that never blocks
//! packet processing and reports its backlog and overflow.
