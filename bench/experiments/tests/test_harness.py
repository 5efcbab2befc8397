"""Unit tests of the experiment harness's logic (no lab, no root):
configuration files, load-generator flags, peak finding, docs sections.

    .venv/bin/python -m pytest bench/experiments/tests -q
"""

import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

import report  # noqa: E402
from cluster import Cluster, Policy, ServerSpec  # noqa: E402
from experiments import UTIL_LADDER, peak  # noqa: E402
from lab import ExperimentError  # noqa: E402
from loadgen import Load, summary  # noqa: E402


class FakeLab:
    """Just enough of `Lab` to build configuration files."""

    def __init__(self, tmp: Path, servers: int = 4):
        self.out_dir = tmp
        self.servers = servers
        self.clients = 1


def test_hostagent_configs_by_mode(tmp_path):
    spec = ServerSpec(service_time_us=1000, service_dist="exp")
    cap = tomllib.loads(Cluster(FakeLab(tmp_path), "capybara", spec).hostagent_toml(2))
    assert cap["stack"]["address"] == "198.18.2.12"
    assert cap["service"][0] == {"listen": "198.18.100.1:80", "app": "testserver", "service_time": "1000us",
                                 "service_dist": "exp", "body_bytes": 256}
    assert cap["policy"]["enabled"] is True
    assert cap["control"]["server_id"] == 2 and cap["control"]["management"] == "198.18.1.12"
    lwrr = tomllib.loads(Cluster(FakeLab(tmp_path), "lwrr", spec).hostagent_toml(1))
    assert lwrr["policy"]["enabled"] is False and "migration" in lwrr
    envoy = tomllib.loads(Cluster(FakeLab(tmp_path), "envoy", spec).hostagent_toml(3))
    # Envoy reaches each server at its data address; no switchd, no migration.
    assert envoy["service"][0]["listen"] == "198.18.2.13:80"
    assert "control" not in envoy and "migration" not in envoy and "policy" not in envoy


def test_switchd_config_lists_every_link_and_uses_lwrr(tmp_path):
    c = Cluster(FakeLab(tmp_path, servers=3), "lwrr", policy=Policy(target_selection="round_robin"))
    cfg = tomllib.loads(c.switchd_toml())
    assert cfg["placement"] == "lwrr" and cfg["target_selection"] == "round_robin"
    assert [(i["name"], i["role"]) for i in cfg["interfaces"]] == [
        ("cl1", "client"), ("sv1", "server"), ("sv2", "server"), ("sv3", "server")]
    assert cfg["services"][0]["vip"] == "198.18.100.1:80"
    assert c.target == "198.18.100.1:80"


def test_envoy_config_names_every_server(tmp_path):
    c = Cluster(FakeLab(tmp_path, servers=2), "envoy")
    y = c.envoy_yaml()
    assert "lb_policy: LEAST_REQUEST" in y
    assert "198.18.2.11" in y and "198.18.2.12" in y and "198.18.2.13" not in y
    assert c.target == "198.18.0.1:80"


def test_unknown_mode_is_rejected(tmp_path):
    with pytest.raises(ExperimentError, match="unknown mode 'maglev'"):
        Cluster(FakeLab(tmp_path), "maglev")


def test_policy_labels():
    assert Policy().label() == "both"
    assert Policy(proactive=False).label() == "reactive"
    assert Policy(reactive=False).label() == "proactive"


def test_load_flags():
    a = Load(duration_s=2.5, util=0.6, capacity_rps=4000, dist="zipf", zipf_alpha=1.2, short_conns=900,
             short_requests=4).args("198.18.100.1:80", Path("/tmp/x.json"))
    flag = lambda f: a[a.index(f) + 1]  # noqa: E731
    assert flag("--duration") == "2500ms" and flag("--zipf-alpha") == "1.2"
    assert flag("--short-conns") == "900" and flag("--short-requests") == "4"
    assert flag("--capacity") == "4000" and flag("--util") == "0.6"
    # Late responses must count as latency, not be cut off as errors.
    assert int(flag("--timeout").removesuffix("ms")) >= 10_000
    u = Load(dist="uniform").args("t:1", Path("j"))
    assert "--zipf-alpha" not in u and "--short-conns" not in u


def test_summary_counts_moved_connections():
    rep = {"requests": 10, "errors": 0, "errors_by_kind": {"timeout": 0},
           "latency": {"all": {"p99_us": 5.0}, "short": {"p99_us": 2.0, "count": 3}},
           "connections": [{"first_server": "s1", "last_server": "s2"},
                           {"first_server": "s1", "last_server": "s1"},
                           {"first_server": None, "last_server": None}]}
    s = summary(rep)
    assert s["moved_conns"] == 1 and s["p99_us"] == 5.0 and s["short_p99_us"] == 2.0
    assert s["long_p99_us"] == 0.0 and s["errors_by_kind"] == {}


def pt(offered, p99, errors=0, achieved=None):
    return {"offered_rps": offered, "p99_us": p99, "errors": errors,
            "achieved_rps": offered if achieved is None else achieved}


def test_peak_is_the_last_step_before_the_first_miss():
    assert peak([pt(100, 10), pt(200, 15), pt(300, 50), pt(400, 10)], slo_us=20) == 200
    assert peak([pt(100, 30)], slo_us=20) == 0.0
    assert peak([pt(200, 10, errors=1), pt(100, 10)], slo_us=20) == 100
    assert peak([pt(100, 10, achieved=80)], slo_us=20) == 0.0
    assert UTIL_LADDER == sorted(UTIL_LADDER)


def test_sections_are_replaced_in_place_and_text_outside_is_kept():
    doc = "# Benchmarks\n\nintro\n"
    once = report.replace_section(doc, "skew", "table 1")
    assert once.startswith(doc.rstrip("\n"))
    assert report.SECTION_TITLE in once and "table 1" in once
    twice = report.replace_section(once + "\ntrailer\n", "skew", "table 2")
    assert "table 1" not in twice and "table 2" in twice and twice.endswith("trailer\n")
    both = report.replace_section(twice, "step", "steps")
    assert both.index("table 2") < both.index("steps")
    assert both.count(report.SECTION_TITLE) == 1


def test_md_table_and_result_line():
    t = report.md_table(["a", "b"], [["x", 1234.5], ["y", 0.5]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| x | 1,234 |", "| y | 0.5 |"]
    assert report.result_line([("k", 1.5), ("big", 12345.6), ("s", "x")]) == "RESULT k=1.500 big=12346 s=x"


def test_plots_render(tmp_path):
    pytest.importorskip("matplotlib")
    pts = [{"mode": m, "dist": d, "p99_us": 1000.0 * (i + 1), "short_p99_us": 500.0}
           for i, m in enumerate(["capybara", "lwrr"]) for d in ["uniform", "zipf-1.2"]]
    report.plot_skew(pts, ["capybara", "lwrr"], tmp_path / "skew.png")
    tl = {"interval_ms": 100.0, "servers": ["s1", "s2"],
          "rows": [{"t_ms": 100.0 * i, "completed": 20, "p99_us": 900.0, "per_server": [10, 10]} for i in range(5)]}
    report.plot_step([{"label": "LWRR", "variant": "lwrr", "capacity_rps": 1000.0, "timeline": tl}],
                     tmp_path / "step.png")
    report.plot_cdf([{"label": "x", "variant": "lwrr", "cdf": [[0.5, 100.0], [0.99, 900.0], [1.0, 1000.0]]}],
                    tmp_path / "cdf.png", "t")
    report.plot_scale([{"servers": n, "series": "s", "peak_rps": 900.0 * n, "capacity_rps": 1000.0}
                       for n in (2, 4)], tmp_path / "scale.png")
    for f in ("skew", "step", "cdf", "scale"):
        assert (tmp_path / f"{f}.png").stat().st_size > 1000


def test_envoy_accepts_the_generated_config(tmp_path):
    """The real Envoy of .venv validates the bootstrap the harness writes."""
    import subprocess

    from lab import envoy_path

    if not envoy_path().exists():
        pytest.skip(f"{envoy_path()} not installed (make setup)")
    f = tmp_path / "envoy.yaml"
    f.write_text(Cluster(FakeLab(tmp_path, servers=4), "envoy").envoy_yaml())
    r = subprocess.run([str(envoy_path()), "--mode", "validate", "-c", str(f)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_seeds_aggregate_to_medians_with_every_value_kept():
    from experiments import aggregate_seeds

    pts = [{"mode": "lwrr", "dist": "zipf-1.2", "seed": s, "p99_us": v, "short_p99_us": 1.0, "p50_us": 1.0,
            "achieved_rps": 10.0, "moved_conns": 0, "busiest_rps": b, "errors": e}
           for s, v, b, e in ((1, 10.0, 900.0, 0), (2, 500.0, 1100.0, 2), (3, 20.0, 950.0, 1))]
    pts.append({**pts[0], "mode": "capybara"})
    agg = aggregate_seeds(pts)
    assert [(a["mode"], a["dist"]) for a in agg] == [("lwrr", "zipf-1.2"), ("capybara", "zipf-1.2")]
    assert agg[0]["p99_us"] == 20.0 and agg[0]["p99_us_each"] == [10.0, 500.0, 20.0]
    assert agg[0]["busiest_rps_each"] == [900.0, 1100.0, 950.0] and agg[0]["errors"] == 3


def test_policy_flag_parsing():
    from run import parse_policy

    p = parse_policy("proactive_threshold_pct=30, reactive_enabled=false,connection_cooldown_ms=5000")
    assert p.proactive and not p.reactive and p.proactive_threshold_pct == 30.0
    assert p.extra == ("connection_cooldown_ms=5000",)
    assert parse_policy("") == Policy()
    for bad in ("foo", "reactive_enabled=maybe", "target_selection=random", "=3"):
        with pytest.raises(ValueError):
            parse_policy(bad)
