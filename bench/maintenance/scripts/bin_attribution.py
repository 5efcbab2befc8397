#!/usr/bin/env python3
"""Per-bin CPU attribution of one bench-maintenance run.

Cuts a system-wide perf cpu-clock recording (traced_run.sh: -a -F 4000
-k CLOCK_MONOTONIC) into the client's 10 ms bins (the run's bin0_mono_ns)
and counts, per bin, the samples of each lab process (the run's `pids`),
of the idle task and of every other process. With 2 CPUs at 4 kHz a bin
holds 80 samples; fewer means the VM itself did not run.

usage: bin_attribution.py RUN_DIR [--worst N]
  RUN_DIR holds bins.csv, pids, bin0_mono_ns and perf.data (traced_run.sh)
"""
import argparse
import collections
import csv
import os
import statistics
import subprocess

LAB = ["client", "switchd", "agent1", "redis1", "agent2", "redis2", "harness"]
BIN_MS = 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--worst", type=int, default=12)
    a = ap.parse_args()
    d = a.run_dir
    with open(os.path.join(d, "pids")) as f:
        pids = {int(p): n for n, p in (kv.split("=") for kv in f.read().strip().split(","))}
    with open(os.path.join(d, "bin0_mono_ns")) as f:
        bin0 = int(f.read())
    with open(os.path.join(d, "bins.csv")) as f:
        bins = {int(r[0]): int(r[1]) for r in list(csv.reader(f))[1:]}
    steady = sorted(bins[m] for m in range(-1000, 0, BIN_MS) if m in bins)
    med = steady[len(steady) // 2]
    script = subprocess.run(
        ["perf", "script", "-i", os.path.join(d, "perf.data"), "-F", "pid,tid,cpu,time,comm"],
        capture_output=True, text=True, check=True,
    ).stdout
    per = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        # "comm pid/tid [cpu] seconds:"
        try:
            left, rest = line.rsplit("[", 1)
            t = float(rest.split("]")[1].strip().rstrip(":"))
            fields = left.split()
            pid = int(fields[-1].split("/")[0])
            comm = " ".join(fields[:-1])
        except (ValueError, IndexError):
            continue
        ms = int((t * 1e9 - bin0) // (BIN_MS * 1_000_000)) * BIN_MS
        name = "idle" if pid == 0 else pids.get(pid, "o:" + comm[:12])
        per[ms][name] += 1

    def others(c):
        return sum(v for k, v in c.items() if k.startswith("o:"))

    def row(ms):
        c = per[ms]
        top = sorted(((v, k[2:]) for k, v in c.items() if k.startswith("o:")), reverse=True)[:3]
        return (f"{ms:6d} {bins.get(ms, 0) / med:5.2f} n={sum(c.values()):3d} "
                + " ".join(f"{k}={c[k]}" for k in LAB + ["idle"])
                + f" other={others(c)} " + ",".join(f"{k}:{v}" for v, k in top))

    print(f"steady median {med} per bin; samples per bin (80 = both CPUs ran)")
    print(f"worst bins (ms after the event, ratio to the steady median):")
    judged = [m for m in range(-1000, 2000, BIN_MS) if m in bins]
    for _, m in sorted((bins[m] / med, m) for m in judged)[: a.worst]:
        print(row(m))
    print("windows (mean ratio, mean samples per bin):")
    for lo, hi in [(-1000, 0), (0, 50), (50, 100), (100, 300), (300, 1000), (1000, 2000)]:
        ms = [m for m in range(lo, hi, BIN_MS) if m in bins]
        if not ms:
            continue
        avg = collections.Counter()
        for m in ms:
            avg.update(per[m])
        r = statistics.mean(bins[m] for m in ms) / med
        print(f"  [{lo},{hi}) {r:4.2f} "
              + " ".join(f"{k}={avg[k] / len(ms):.1f}" for k in LAB + ["idle"])
              + f" other={others(avg) / len(ms):.1f} n={sum(avg.values()) / len(ms):.1f}")


if __name__ == "__main__":
    main()
