//! The switch: data plane and control plane of the load balancer.
//!
//! `switchd` owns the `DataPlane` trait and its backends (eBPF/XDP programs in
//! `bpf/`, the Tofino P4 program in `p4/`, an in-memory backend for control
//! plane tests), and the control plane that drives them: service addresses
//! and pools, Maglev and LWRR placement computed in user space and pushed as
//! deltas, the migration table, the pool monitor and its load notifications,
//! server registration and liveness, drains, flow persistence to the store,
//! and active/standby takeover. The data plane never makes a policy decision.

pub mod abi;
pub mod bpf;
pub mod config;
pub mod control;
pub mod daemon;
pub mod dataplane;
pub mod embryonic;
pub mod labkit;
pub mod maglev;
pub mod persist;
pub mod services;
pub mod sys;

pub use dataplane::{DataPlane, DataPlaneError, MemDataPlane};
pub mod netns;
pub mod packet;
