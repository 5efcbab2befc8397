"""Runs capybara-loadgen in the client namespace and reads its JSON report."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lab import ExperimentError, Lab, bin_path


@dataclass
class Load:
    """One load-generator run (flags of bench/loadgen; see bench/README.md)."""

    duration_s: float = 8.0
    util: float = 0.6
    capacity_rps: float = 8000.0
    conns: int = 100
    dist: str = "uniform"  # uniform | zipf | step
    zipf_alpha: float = 1.0
    short_conns: int = 0
    short_requests: int = 1
    interval_ms: int = 100
    body_bytes: int = 256
    seed: int = 1
    # A late response is a latency, not an error: the timeout must exceed
    # the longest queue an overloaded baseline can build in one run.
    timeout_s: float = 30.0
    max_outstanding: int = 100_000
    probe: bool = False
    extra: list[str] = field(default_factory=list)

    def args(self, target: str, json_path: Path) -> list[str]:
        a = [
            "--target", target,
            "--duration", f"{int(self.duration_s * 1000)}ms",
            "--util", f"{self.util}",
            "--capacity", f"{self.capacity_rps:.0f}",
            "--conns", str(self.conns),
            "--dist", self.dist,
            "--interval", f"{self.interval_ms}ms",
            "--expect-body", str(self.body_bytes),
            "--seed", str(self.seed),
            "--timeout", f"{int(self.timeout_s * 1000)}ms",
            "--max-outstanding", str(self.max_outstanding),
            "--json", str(json_path),
        ]
        if self.dist == "zipf":
            a += ["--zipf-alpha", f"{self.zipf_alpha}"]
        if self.short_conns:
            a += ["--short-conns", str(self.short_conns), "--short-requests", str(self.short_requests),
                  "--max-short-inflight", "2000"]
        if self.probe:
            a += ["--probe"]
        return a + [str(x) for x in self.extra]


def run_load(lab: Lab, target: str, load: Load, json_path: Path, log_path: Path) -> dict:
    """Runs the load generator in c1 to completion; returns its JSON report.

    Bounded: the run is killed after duration + timeout + 60 s."""
    loadgen = bin_path("capybara-loadgen")
    if not loadgen.exists():
        raise ExperimentError(f"missing {loadgen}")
    json_path.unlink(missing_ok=True)
    argv = [loadgen, *load.args(target, json_path)]
    limit = load.duration_s + load.timeout_s + 60
    try:
        r = lab.run("c1", argv, timeout=limit)
    except subprocess.TimeoutExpired as e:
        raise ExperimentError(f"capybara-loadgen ran longer than {limit:.0f}s: {' '.join(map(str, argv))}") from e
    log_path.write_text(f"$ {' '.join(map(str, argv))}\n{r.stdout}\n{r.stderr}")
    if r.returncode != 0 or not json_path.exists():
        raise ExperimentError(f"capybara-loadgen failed (status {r.returncode}); log {log_path}:\n{r.stderr[-2000:]}")
    return json.loads(json_path.read_text())


def summary(report: dict) -> dict:
    """The numbers the experiments tabulate, from one loadgen report."""
    lat = report.get("latency", {})

    def p(kind: str, q: str) -> float:
        return float(lat.get(kind, {}).get(q, 0.0) or 0.0)

    return {
        "requests": report.get("requests", 0),
        "errors": report.get("errors", 0),
        "errors_by_kind": {k: v for k, v in report.get("errors_by_kind", {}).items() if v},
        "offered_rps": report.get("offered_rps", 0.0),
        "achieved_rps": report.get("achieved_rps", 0.0),
        "p50_us": p("all", "p50_us"),
        "p99_us": p("all", "p99_us"),
        "p999_us": p("all", "p999_us"),
        "max_us": p("all", "max_us"),
        "short_p99_us": p("short", "p99_us"),
        "long_p99_us": p("long", "p99_us"),
        "short_count": lat.get("short", {}).get("count", 0),
        "per_server": report.get("per_server", {}),
        # Requests/s served by the busiest server over the run.
        "busiest_rps": (max(report.get("per_server", {}).values(), default=0) / report["duration_s"]
                        if report.get("duration_s") else 0.0),
        "moved_conns": sum(1 for c in report.get("connections", [])
                           if c.get("first_server") and c.get("last_server")
                           and c["first_server"] != c["last_server"]),
    }
