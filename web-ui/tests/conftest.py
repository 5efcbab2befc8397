"""Fixtures for the dashboard's browser tests: the real API server
(`capybara-api`, store-backed control plane, SQLite store in a temp dir)
serving the built dashboard (web-ui/dist), and headless Debian chromium
driven by playwright.

Environment:
  CAPYBARA_API_BIN         the capybara-api binary (default: target/{debug,release}/capybara-api)
  CAPYBARA_TEST_OUTPUT     screenshots go to $CAPYBARA_TEST_OUTPUT/ui (default: <repo>/test-output)
  CAPYBARA_CHROMIUM        chromium executable (default: /usr/bin/chromium)
"""
import ipaddress
import json
import os
import re
import sqlite3
import subprocess
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import requests
from playwright.sync_api import sync_playwright

WEB_UI = Path(__file__).resolve().parent.parent
REPO = WEB_UI.parent
DIST = WEB_UI / "dist"
SCREENSHOTS = Path(os.environ.get("CAPYBARA_TEST_OUTPUT", REPO / "test-output")) / "ui"
START_TIMEOUT_S = 30


def api_binary() -> Path:
    env = os.environ.get("CAPYBARA_API_BIN")
    if env:
        return Path(env)
    candidates = [REPO / "target" / p / "capybara-api" for p in ("debug", "release")]
    existing = [c for c in candidates if c.exists()]
    if not existing:
        pytest.fail("capybara-api not built: run `cargo build -p capybara-api` or set CAPYBARA_API_BIN")
    return max(existing, key=lambda c: c.stat().st_mtime)


class Api:
    """A running capybara-api and an admin session on it."""

    def __init__(self, url: str, token: str, store_path: Path, process: "ApiProcess"):
        self.process = process
        self.url = url
        self.token = token
        self.store_path = store_path
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def req(self, method: str, path: str, expect: int, **kw):
        r = self.http.request(method, self.url + path, timeout=10, **kw)
        assert r.status_code == expect, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else None

    def restart(self, while_down=None):
        """Stops the API, runs `while_down()`, starts it again on the same address."""
        self.process.stop()
        if while_down:
            while_down()
        listen = self.url.removeprefix("http://")
        assert self.process.start(listen) == self.url

    def get(self, path: str):
        return self.req("GET", path, 200)

    def wait_for(self, what: str, check, timeout_s: float = 10.0):
        """Polls `check()` (bounded) until it returns a truthy value."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = check()
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    # The switch is not wired to the API yet, so nothing writes flow
    # mappings. These helpers stand in for switchd's flow writer: they write
    # the `flows` table of the SQLite store exactly as the store's flow
    # writer does (store/src/sqlite.rs, flow_params), which is what the
    # store-backed control plane reads for connection counts and drain
    # progress. Replace them with real traffic through the lab when it is
    # wired to the API.
    def _flows_db(self):
        db = sqlite3.connect(self.store_path, timeout=5)
        db.execute("PRAGMA busy_timeout = 5000")
        return db

    def put_flows(self, server: int, clients: list[tuple[str, int]], vip: str, port: int):
        with self._flows_db() as db:
            db.executemany(
                "INSERT OR REPLACE INTO flows (client_ip, client_port, service_ip, service_port, server) VALUES (?, ?, ?, ?, ?)",
                [(int(ipaddress.IPv4Address(ip)), cport, int(ipaddress.IPv4Address(vip)), port, server) for ip, cport in clients],
            )

    def hostagent_registers(self, server: int, state: str = "active"):
        """Writes server `server`'s record as switchd does from its
        hostagent's REGISTER (the data MAC: no longer `never_seen`) and its
        liveness `state` (`active`, `dead`), in the store's JSON envelope
        (store/src/codec.rs). No change is logged: a page opened afterwards
        lists it."""
        with self._flows_db() as db:
            (value,) = db.execute("SELECT value FROM servers WHERE id = ?", (server,)).fetchone()
            rec = json.loads(value)
            rec["data"]["data_mac"] = f"02:00:00:00:00:{server:02x}"
            rec["data"]["state"] = state
            db.execute("UPDATE servers SET value = ? WHERE id = ?", (json.dumps(rec).encode(), server))

    def move_flows(self, from_server: int, to_server: int, count: int):
        with self._flows_db() as db:
            rows = db.execute(
                "SELECT client_ip, client_port, service_ip, service_port FROM flows WHERE server = ? ORDER BY client_port LIMIT ?",
                (from_server, count),
            ).fetchall()
            db.executemany(
                "UPDATE flows SET server = ? WHERE client_ip = ? AND client_port = ? AND service_ip = ? AND service_port = ?",
                [(to_server, *r) for r in rows],
            )
            return len(rows)


class ApiProcess:
    """One capybara-api process; `restart()` stops it and starts a new one
    on the same address and store (what an operator sees when the API
    restarts)."""

    def __init__(self, tmp: Path, extra_args: tuple[str, ...] = ()):
        self.tmp = tmp
        self.extra_args = list(extra_args)
        self.store = tmp / "store.db"
        self.token_file = tmp / "admin.token"
        self.proc = None
        self.log = None
        self.runs = 0

    def start(self, listen: str = "127.0.0.1:0") -> str:
        self.runs += 1
        log_path = self.tmp / f"api-{self.runs}.log"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [
                str(api_binary()),
                "--store", f"sqlite:{self.store}",
                "--listen", listen,
                "--admin-token-file", str(self.token_file),
                "--static-dir", str(DIST),
                *self.extra_args,
            ],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        # The server prints `listening on http://ADDR` once bound. Read stdout
        # on a thread so the wait is bounded even if it prints nothing.
        found = {}
        ready = threading.Event()
        proc = self.proc

        def read_stdout():
            for line in proc.stdout:
                m = re.search(r"listening on (http://\S+)", line)
                if m and "url" not in found:
                    found["url"] = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or "url" not in found:
            self.stop()
            pytest.fail(f"capybara-api did not start; log:\n{log_path.read_text()}")
        url = found["url"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while requests.get(url + "/readyz", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "capybara-api never became ready"
            time.sleep(0.1)
        return url

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        self.log.close()


class SwitchdStandIn:
    """A stand-in for switchd's HTTP endpoint (`metrics_listen`) on
    127.0.0.1: `GET /status` answers `status` as it is at each request (a
    test changes it as switchd would), `GET /migrations?after=A&limit=L`
    the reports of `migrations` (none by default) with a `seq` above A, L
    at most, as switchd pages them. `migrations` holds the servers'
    reports in order, seq 1, 2, ...: a test extends it (with a list, so
    that a request sees all of them or none) as servers report."""

    def __init__(self, status: dict, migrations: list[dict] | None = None):
        self.status = status
        self.migrations = [] if migrations is None else migrations
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/status"):
                    body = stand_in.status
                elif self.path.startswith("/migrations"):
                    q = {k: int(v[0]) for k, v in parse_qs(urlparse(self.path).query).items()}
                    after, limit = q.get("after", 0), q.get("limit", 1000)
                    reports = list(stand_in.migrations)
                    items = [r for r in reports if r["seq"] > after][:limit]
                    next_seq = reports[-1]["seq"] + 1 if reports else 1
                    body = {"epoch": 1, "next": next_seq, "items": items}
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@contextmanager
def api_behind_switchd(tmp: Path, status: dict, migrations: list[dict] | None = None):
    """A capybara-api of its own (store in `tmp`) whose control plane is a
    `SwitchdStandIn` answering `status` and `migrations`: yields (Api,
    SwitchdStandIn)."""
    switchd = SwitchdStandIn(status, migrations)
    p = ApiProcess(tmp, ("--switchd", switchd.url))
    try:
        url = p.start()
        yield Api(url, p.token_file.read_text().strip(), p.store, p), switchd
    finally:
        p.stop()
        switchd.close()


@pytest.fixture(scope="session")
def api(tmp_path_factory):
    if not (DIST / "index.html").exists():
        pytest.fail(f"{DIST} is not built: run web-ui/build.sh")
    p = ApiProcess(tmp_path_factory.mktemp("capybara-api"))
    try:
        url = p.start()
        a = Api(url, p.token_file.read_text().strip(), p.store, p)
        seed(a)
        yield a
    finally:
        p.stop()


SERVERS = [
    {"id": 1, "name": "web-1", "mgmt_addr": "10.0.1.11:7000", "data_addr": "10.0.2.11"},
    {"id": 2, "name": "web-2", "mgmt_addr": "10.0.1.12:7000", "data_addr": "10.0.2.12"},
    {"id": 3, "name": "web-3", "mgmt_addr": "10.0.1.13:7000", "data_addr": "10.0.2.13"},
]
VIP, PORT = "10.0.0.100", 80


def seed(a: Api):
    """Three servers and one service over them, registered through the REST API."""
    for s in SERVERS:
        a.req("POST", "/v1/servers", 201, json=s)
    a.req("POST", "/v1/services", 201, json={"name": "web", "vip": VIP, "port": PORT, "pool": [1, 2, 3]})


@pytest.fixture(scope="session")
def browser():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=os.environ.get("CAPYBARA_CHROMIUM", "/usr/bin/chromium"),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.set_default_timeout(10_000)
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def shot():
    """shot(page, name): saves test-output/ui/NAME.png."""
    def take(pg, name: str):
        pg.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    return take
