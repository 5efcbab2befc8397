//! `capybara-loadgen`: the load generator of the Capybara experiments
//! (seed 000 §8.1). Open-loop Poisson arrivals over long-lived HTTP/1.1
//! keep-alive connections whose rates follow a uniform, Zipf or step
//! distribution, plus short-lived connections; latency measured from each
//! request's *scheduled* send time into HDR histograms; per-interval
//! timelines with per-server counts (`x-server`); errors by kind.
//! See bench/README.md for the flags and lab invocations.

pub mod config;
pub mod http;
pub mod run;
pub mod schedule;
pub mod stats;

pub use config::{Args, Config, Dist, StepConfig, StepSubset};
pub use run::{long_weights, run, run_blocking};
pub use stats::Report;
