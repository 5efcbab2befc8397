#!/usr/bin/env python3
"""Runs one experiment of seed 000 §8.1 in the namespace lab.

    .venv/bin/python bench/experiments/run.py skew|step|target|scale [options]

Needs root (network namespaces, eBPF) and the release binaries (capybara,
switchd, hostagent, capybara-loadgen; `make setup` builds them). The last
line printed is `RESULT key=value ...`. See bench/README.md (Experiments).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import MODES, Policy, ServerSpec  # noqa: E402
from experiments import EXPERIMENTS, SKEW_DISTS, Context, scale  # noqa: E402
from lab import ROOT, ExperimentError, install_signal_handlers  # noqa: E402

DEFAULT_DURATION = {"skew": 12.0, "step": 8.0, "target": 8.0, "scale": 4.0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--modes", default=",".join(MODES),
                    help="systems to run, comma-separated (default: all of capybara,lwrr,envoy)")
    ap.add_argument("--duration", type=float, help="seconds per measured point (skew 12, step 8 = 1 s steps, "
                                                   "target 8, scale 4)")
    ap.add_argument("--service-time-us", type=int, default=1000, help="emulated service time per request (µs)")
    ap.add_argument("--service-dist", choices=["fixed", "exp"], default="fixed")
    ap.add_argument("--servers", default="2,4,8", help="bench-scale: pool sizes, comma-separated")
    ap.add_argument("--slo-ms", type=float, default=200.0, help="bench-scale: p99 SLO of a peak (ms)")
    ap.add_argument("--policy", default="",
                    help="capybara runs: policy settings KEY=VALUE[,KEY=VALUE...] as for `capybara ctl policy set` "
                         "(e.g. proactive_threshold_pct=30,connection_cooldown_ms=5000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", default="1,2,3", help="bench-skew and bench-target: seeds, each point is run once per seed")
    ap.add_argument("--dists", default="",
                    help="bench-skew: load distributions to run, comma-separated (default: all of "
                         "uniform,zipf-0.9,zipf-1.0,zipf-1.1,zipf-1.2); to iterate on single points")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness of every lab process (switchd, hostagents, Envoy, load generator); "
                         "negative puts them ahead of other work on a shared machine; 0 = unchanged")
    ap.add_argument("--out", type=Path, help="raw results directory (default test-output/experiments/NAME)")
    ap.add_argument("--write-docs", action="store_true",
                    help="write the plot to docs/img/ and the table to docs/BENCHMARKS.md")
    a = ap.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)} (expected {', '.join(MODES)})")
    if a.service_time_us <= 0:
        ap.error(f"--service-time-us {a.service_time_us}: must be positive")
    try:
        a.sizes = [int(x) for x in a.servers.split(",")]
    except ValueError:
        ap.error(f"--servers {a.servers!r}: expected numbers like 2,4,8")
    try:
        a.seed_list = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {a.seeds!r}: expected numbers like 1,2,3")
    if any(n < 1 or n > 50 for n in a.sizes):
        ap.error(f"--servers {a.servers!r}: each size must be 1..=50")
    a.dist_list = [d.strip() for d in a.dists.split(",") if d.strip()]
    known = [d for d, _ in SKEW_DISTS]
    if any(d not in known for d in a.dist_list):
        ap.error(f"--dists {a.dists!r}: expected some of {','.join(known)}")
    try:
        a.policy_obj = parse_policy(a.policy)
    except ValueError as e:
        ap.error(f"--policy: {e}")
    return a


def parse_policy(text: str) -> Policy:
    """`KEY=VALUE,...` into a `Policy`: the fields the harness knows become
    fields, the others are passed to `capybara ctl policy set` as they are
    (the API validates them and names a bad one)."""
    p = Policy()
    extra = []
    for item in [x.strip() for x in text.replace(" ", ",").split(",") if x.strip()]:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        if key in ("proactive_enabled", "reactive_enabled"):
            if value not in ("true", "false"):
                raise ValueError(f"{item!r}: expected true or false")
            setattr(p, key.removesuffix("_enabled"), value == "true")
        elif key == "proactive_threshold_pct":
            p.proactive_threshold_pct = float(value)
        elif key == "reactive_backlog_threshold":
            p.reactive_backlog_threshold = int(value)
        elif key == "target_selection":
            if value not in ("round_robin", "least_loaded"):
                raise ValueError(f"{item!r}: expected round_robin or least_loaded")
            p.target_selection = value
        else:
            extra.append(item)
    p.extra = tuple(extra)
    return p


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        print("run.py: needs root (network namespaces, eBPF)", file=sys.stderr)
        return 2
    install_signal_handlers()
    out = a.out or ROOT / "test-output" / "experiments" / a.experiment
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        name=a.experiment, out_dir=out,
        server=ServerSpec(service_time_us=a.service_time_us, service_dist=a.service_dist),
        duration_s=a.duration or DEFAULT_DURATION[a.experiment], modes=a.modes,
        write_docs=a.write_docs, seed=a.seed, seeds=a.seed_list, dists=a.dist_list, nice=a.nice, policy=a.policy_obj, command=shlex.join(["run.py", *argv]),
    )
    start = time.monotonic()
    try:
        if a.experiment == "scale":
            result = scale(ctx, a.sizes, a.slo_ms)
        else:
            result = EXPERIMENTS[a.experiment](ctx)
    except ExperimentError as e:
        print(f"run.py {a.experiment}: {e}", file=sys.stderr)
        return 1
    ctx.log(f"done in {time.monotonic() - start:.0f}s; raw results in {out}")
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
