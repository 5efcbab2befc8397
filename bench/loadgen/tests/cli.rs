//! Flag validation: bad input gives one clear error naming the value.

use capybara_loadgen::Args;
use clap::Parser;

fn err(args: &[&str]) -> String {
    let mut v = vec!["capybara-loadgen"];
    v.extend_from_slice(args);
    match Args::try_parse_from(v) {
        Err(e) => e.to_string(),
        Ok(a) => a.to_config().expect_err("config should be rejected"),
    }
}

fn ok(args: &[&str]) -> capybara_loadgen::Config {
    let mut v = vec!["capybara-loadgen"];
    v.extend_from_slice(args);
    Args::try_parse_from(v).unwrap().to_config().unwrap()
}

#[test]
fn rejects_bad_flags_naming_the_value() {
    let t = "--target=127.0.0.1:80";
    assert!(err(&["--target=nowhere", "--rate=1"]).contains("nowhere"));
    assert!(err(&[t, "--rate=-5"]).contains("-5"));
    assert!(err(&[t, "--rate=1", "--duration=10"]).contains("\"10\""));
    assert!(err(&[t, "--rate=1", "--duration=3parsecs"]).contains("3parsecs"));
    assert!(err(&[t, "--rate=1", "--dist=pareto"]).contains("pareto"));
    assert!(err(&[t, "--rate=1", "--dist=zipf", "--zipf-alpha=-1"]).contains("-1"));
    assert!(err(&[t]).contains("--rate"));
    assert!(err(&[t, "--util=0.5"]).contains("capacity"));
    assert!(err(&[t, "--rate=1", "--short-share=1.5"]).contains("1.5"));
    assert!(err(&[t, "--rate=10", "--duration=1s", "--short-conns=900"]).contains("short"));
    assert!(err(&[t, "--rate=1", "--dist=step"]).contains("--step-conns"));
    assert!(err(&[
        t,
        "--rate=1",
        "--dist=step",
        "--conns=10",
        "--step-conns=5-20",
        "--step-rps=1"
    ])
    .contains("20"));
    assert!(err(&[t, "--rate=1", "--step-rps=1"]).contains("--dist step"));
    assert!(err(&[t, "--rate=1", "--path=nope"]).contains("nope"));
    assert!(err(&[t, "--rate=1", "--interval=1us"]).contains("1us"));
    assert!(err(&[t, "--rate=1", "--max-outstanding=0"]).contains("0"));
}

#[test]
fn accepts_the_paper_workloads() {
    // §8.1.1: 4 servers at 60%, 100 long + 900 short connections, Zipf 1.2.
    let c = ok(&[
        "--target=198.18.100.1:80",
        "--util=0.6",
        "--capacity=40000",
        "--conns=100",
        "--dist=zipf",
        "--zipf-alpha=1.2",
        "--short-conns=900",
        "--duration=10s",
    ]);
    assert!((c.rate - 24000.0).abs() < 1e-9);
    assert!((c.short_rate - 90.0).abs() < 1e-9);
    // §8.1.2: step function, 2 servers, 20% each, +40% on server 0 every 20 ms.
    let c = ok(&[
        "--target=198.18.100.1:80",
        "--util=0.2",
        "--capacity=20000",
        "--conns=100",
        "--dist=step",
        "--step-server=s0",
        "--step-util=0.2",
        "--step-interval=20ms",
        "--duration=200ms",
        "--interval=10ms",
    ]);
    let s = c.step.unwrap();
    assert!((s.step_rps - 4000.0).abs() < 1e-9);
    assert_eq!(s.interval.as_millis(), 20);
}
