"""Tables, plots and the docs/BENCHMARKS.md sections of the experiments."""

from __future__ import annotations

import re
from pathlib import Path

from lab import ROOT

BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"
IMG_DIR = ROOT / "docs" / "img"
SECTION_TITLE = "## Experiments: load balancing under skew (seed 000 §8.1)"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- experiment:{name}:begin -->", f"<!-- experiment:{name}:end -->"


def replace_section(text: str, name: str, body: str) -> str:
    """Puts `body` between the markers of experiment `name` in `text`.

    Missing markers are added at the end of the experiments section (which
    is created at the end of the file when absent); everything outside the
    markers is kept byte for byte."""
    begin, end = markers(name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _m: block, text, count=1)
    if SECTION_TITLE not in text:
        text = text.rstrip("\n") + "\n\n" + SECTION_TITLE + "\n"
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(replace_section(text, name, body))


def md_table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def result_line(pairs: list[tuple[str, object]]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    return "RESULT " + " ".join(f"{k}={fmt(v)}" for k, v in pairs)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MODE_COLORS = {"capybara": "#1b9e77", "lwrr": "#d95f02", "envoy": "#7570b3",
               "round_robin": "#e7298a", "least_loaded": "#1b9e77",
               "reactive": "#e6ab02", "proactive": "#66a61e", "both": "#1b9e77"}


def plot_skew(points: list[dict], modes: list[str], out: Path) -> None:
    """Figure 7: p99 of all requests and of short-flow requests, per load
    distribution of the long flows, one bar per mode (log scale)."""
    plt = _plt()
    dists = []
    for p in points:
        if p["dist"] not in dists:
            dists.append(p["dist"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    width = 0.8 / max(1, len(modes))
    for ax, key, title in ((axes[0], "p99_us", "all requests"), (axes[1], "short_p99_us", "short flows")):
        for k, mode in enumerate(modes):
            ys = []
            for d in dists:
                m = [p for p in points if p["dist"] == d and p["mode"] == mode]
                ys.append(m[0][key] / 1000 if m and m[0][key] else float("nan"))
            xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(dists))]
            ax.bar(xs, ys, width, label=mode, color=MODE_COLORS.get(mode))
        ax.set_xticks(range(len(dists)), dists)
        ax.set_yscale("log")
        ax.set_title(f"p99 latency, {title}")
        ax.set_xlabel("load distribution of the long-lived connections")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("p99 latency (ms)")
    axes[1].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_step(runs: list[dict], out: Path) -> None:
    """Figure 8: per-server and total throughput (top) and per-interval p99
    (bottom) over time, one column per variant."""
    plt = _plt()
    fig, axes = plt.subplots(2, len(runs), figsize=(3.4 * len(runs), 5.2), sharex=True, sharey="row", squeeze=False)
    for c, run in enumerate(runs):
        tl = run["timeline"]
        dt = tl["interval_ms"] / 1000.0
        t = [r["t_ms"] for r in tl["rows"]]
        top, bottom = axes[0][c], axes[1][c]
        cap = run["capacity_rps"]
        # Same colour for the same server in every column.
        for k, (i, s) in enumerate(sorted(enumerate(tl["servers"]), key=lambda x: x[1])):
            top.plot(t, [100 * r["per_server"][i] / dt / cap for r in tl["rows"]], label=s, color=f"C{k}")
        top.plot(t, [100 * r["completed"] / dt / (cap * len(tl["servers"] or [1])) for r in tl["rows"]],
                 "k--", label="total (of pool)")
        top.set_title(run["label"])
        top.set_ylim(0, 160)
        top.grid(alpha=0.3)
        bottom.plot(t, [max(r["p99_us"], 1) / 1000 for r in tl["rows"]], color=MODE_COLORS.get(run["variant"], "C0"))
        bottom.set_yscale("log")
        bottom.grid(alpha=0.3, which="both")
        bottom.set_xlabel("time (ms)")
    axes[0][0].set_ylabel("served load (% of one server)")
    axes[1][0].set_ylabel("p99 per interval (ms)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_cdf(runs: list[dict], out: Path, title: str) -> None:
    """Figure 17: latency CDF (top of the distribution) per variant."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in runs:
        cdf = run["cdf"]
        ax.plot([v / 1000 for _q, v in cdf], [q for q, _v in cdf], marker=".",
                label=run["label"], color=MODE_COLORS.get(run["variant"]))
    ax.set_xscale("log")
    ax.set_ylim(0.5, 1.0)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_scale(rows: list[dict], out: Path) -> None:
    """Figure 10: peak throughput under the p99 SLO as servers grow."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    series = []
    for r in rows:
        if r["series"] not in series:
            series.append(r["series"])
    for s in series:
        pts = sorted((r["servers"], r["peak_rps"]) for r in rows if r["series"] == s)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=s)
    ns = sorted({r["servers"] for r in rows})
    if rows:
        cap = rows[0]["capacity_rps"]
        ax.plot(ns, [n * cap for n in ns], ":", color="grey", label="pool capacity")
    ax.set_xlabel("servers")
    ax.set_ylabel("peak throughput within p99 SLO (req/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
