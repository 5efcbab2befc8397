"""The dashboard in a real headless browser against a running lab: the demo
deployment (scripts/demo.sh: switchd's XDP data plane, three hostagents,
capybara-api wired to switchd, a skewed client load from the client
namespace), on its own lab prefix, state directory and port so that it does
not collide with a developer's `make demo`.

An operator's session, step by step, with a screenshot of each step under
test-output/ui/lab-*.png: log in, see three servers with live load, drain one
and watch its connection count reach zero while the chart keeps updating,
undrain it, change a policy threshold and see it reach the data plane.

Needs root (namespaces, eBPF) and the release binaries (`make build`).
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Page, expect

from conftest import REPO, SCREENSHOTS

START_TIMEOUT_S = 120


class DemoLab:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.prefix = f"ui{os.getpid() % 100000}"
        self.port = 18000 + os.getpid() % 1000
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = tmp / "out"
        self.state = tmp / "state"
        self.log = open(tmp / "demo.log", "w")
        env = dict(os.environ)
        env.update(
            CAPYBARA_LAB_PREFIX=self.prefix,
            CAPYBARA_DEMO_PORT=str(self.port),
            CAPYBARA_DEMO_DIR=str(self.state),
            CAPYBARA_DEMO_OUT=str(self.out),
            # A backstop: the demo stops itself even if this process dies.
            CAPYBARA_DEMO_SECONDS="600",
        )
        self.proc = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "demo.sh")],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        token_file = self.out / "admin-token"
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the demo exited ({self.proc.returncode}): {self.tail()}")
            if token_file.exists() and self._healthy():
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the demo did not come up in {START_TIMEOUT_S}s: {self.tail()}")
            time.sleep(0.5)
        self.token = token_file.read_text().strip()
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {self.token}"

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def tail(self) -> str:
        self.log.flush()
        return (self.tmp / "demo.log").read_text()[-3000:]

    def get(self, path: str):
        try:
            r = self.http.get(self.url + path, timeout=10)
        except requests.ConnectionError:
            # The API closes a keep-alive connection idle for 5 s (actix's
            # default); a GET sent on it at that very moment finds it closed
            # without an answer (seen once in CI). A browser retries an
            # idempotent request then; so does this client, once.
            r = self.http.get(self.url + path, timeout=10)
        assert r.status_code == 200, f"GET {path}: {r.status_code} {r.text}"
        return r.json()

    def switchd_status(self) -> dict:
        out = subprocess.run(
            ["ip", "netns", "exec", f"{self.prefix}-sw", "curl", "-sf", "-m", "2", "http://127.0.0.1:9102/status"],
            capture_output=True, text=True, timeout=10,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # The demo tears its lab down; make sure, whatever happened.
        # The binary the demo ran (scripts/demo.sh: CAPYBARA_BIN_DIR's when it holds one).
        capybara = Path(os.environ.get("CAPYBARA_BIN_DIR", REPO / "target" / "release")) / "capybara"
        if not capybara.exists():
            capybara = REPO / "target" / "release" / "capybara"
        subprocess.run([str(capybara), "lab", "down", "--prefix", self.prefix],
                       capture_output=True, timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the lab needs root (network namespaces, eBPF)")
    d = DemoLab(tmp_path_factory.mktemp("demo-lab"))
    try:
        yield d
    finally:
        d.stop()


def login(page: Page, lab: DemoLab):
    page.goto(lab.url + "/")
    page.get_by_test_id("login-token").fill(lab.token)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("stream-status")).to_have_attribute("data-status", "live")


def wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        v = check()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.25)


def count(page: Page, test_id: str) -> int:
    text = page.get_by_test_id(test_id).inner_text().strip()
    return int(text) if text.isdigit() else -1


def chart_points(page: Page) -> int:
    return int(page.get_by_test_id("chart-connections").get_attribute("data-points") or 0)


def test_operator_drains_and_undrains_a_server_in_a_running_lab(page: Page, lab: DemoLab, shot):
    page.set_default_timeout(30_000)
    login(page, lab)
    expect(page.get_by_test_id("whoami")).to_have_attribute("data-role", "admin")

    # Three servers, each serving connections, with live load numbers.
    for sid in (1, 2, 3):
        expect(page.get_by_test_id(f"server-state-{sid}")).to_have_text("active")
    wait_for("every server to carry connections",
             lambda: all(count(page, f"server-connections-{sid}") > 0 for sid in (1, 2, 3)), 60)
    def live_load(sid: int) -> bool:
        text = page.get_by_test_id(f"server-load-{sid}").inner_text()
        return re.match(r"^[0-9.]+ [kM]?pps$", text) is not None and not text.startswith("0 ")
    wait_for("live load on every server", lambda: all(live_load(sid) for sid in (1, 2, 3)), 60)
    servers = lab.get("/v1/servers")["items"]
    assert all((s["stats"]["load_pps"] or 0) > 0 for s in servers), servers
    shot(page, "lab-01-three-servers-live")

    # Drain server 1: its connections migrate away, the count reaches zero.
    before = count(page, "server-connections-1")
    points_before = chart_points(page)
    page.get_by_test_id("drain-button-1").click()
    page.get_by_test_id("drain-deadline-1").fill("60")
    page.get_by_test_id("drain-mode-1").select_option("migrate")
    page.get_by_test_id("drain-confirm-1").click()
    expect(page.get_by_test_id("server-state-1")).to_have_text(re.compile("draining|drained"))
    shot(page, "lab-02-draining")
    expect(page.get_by_test_id("server-state-1")).to_have_text("drained", timeout=60_000)
    expect(page.get_by_test_id("server-connections-1")).to_have_text("0")
    drain = lab.get("/v1/servers/1/drain")
    assert drain["state"] == "completed", drain
    # The other servers took the connections; the chart kept updating.
    wait_for("the chart to gain points", lambda: chart_points(page) > points_before, 10)
    others = count(page, "server-connections-2") + count(page, "server-connections-3")
    assert others > 0, f"server 1 had {before} connections; where did they go?"
    shot(page, "lab-03-drained")

    # Undrain: the server is active again and gets new connections.
    page.get_by_test_id("undrain-button-1").click()
    expect(page.get_by_test_id("server-state-1")).to_have_text("active")
    wait_for("server 1 to get connections again", lambda: count(page, "server-connections-1") > 0, 60)
    shot(page, "lab-04-undrained")


def test_policy_change_reaches_the_data_plane(page: Page, lab: DemoLab, shot):
    page.set_default_timeout(30_000)
    login(page, lab)
    before = lab.get("/v1/policy")["proactive_threshold_pct"]
    want = 25.0 if before != 25.0 else 30.0
    page.get_by_test_id("nav-policy").click()
    field = page.get_by_test_id("policy-field-proactive_threshold_pct")
    field.fill(str(int(want)))
    page.get_by_test_id("policy-save").click()
    wait_for("the API to hold the new threshold",
             lambda: lab.get("/v1/policy")["proactive_threshold_pct"] == want, 10)
    # Taking effect: switchd (which pushes the tunables to every hostagent)
    # runs with the new value within a second or two.
    wait_for("switchd to run with the new threshold",
             lambda: (lab.switchd_status().get("policy") or {}).get("proactive_threshold_pct") == want, 10)

    # ... and every hostagent acknowledges the new policy generation in its
    # heartbeats (switchd pushes the tunables; servers apply them).
    def servers_applied():
        st = lab.switchd_status()
        gen = st["policy"]["generation"]
        return len(st["servers"]) == 3 and all(s.get("policy_generation") == gen for s in st["servers"])
    wait_for("every server to apply the new policy", servers_applied, 10)
    shot(page, "lab-05-policy-applied")


def test_services_page_shows_what_the_data_plane_serves(page: Page, lab: DemoLab, shot):
    # The demo's configured service is in the store (switchd writes it
    # there) and switchd serves it on every server: the Services page says
    # so from switchd's view, and refreshes it on its own.
    page.set_default_timeout(30_000)
    login(page, lab)
    page.get_by_test_id("nav-services").click()
    expect(page.get_by_test_id("service-row-web")).to_be_visible()
    cell = page.get_by_test_id("service-serving-web")
    expect(cell.locator("[data-served='true']")).to_be_visible()
    for name in ("s1", "s2", "s3"):
        expect(cell).to_contain_text(name)
    shot(page, "lab-06-services")


def test_migration_feed_shows_export_import_times_and_24_hour_clock(browser, lab: DemoLab, shot):
    # One connection moved by hand (what `capybara ctl migrate` asks): the
    # feed row shows its export and import times, which the hostagents
    # measure (they were "0 µs" for every migration: both ends of each phase
    # were stamped with the same poll-loop time), and its start as a 24-hour
    # HH:MM:SS.mmm, in an en-US browser whose toLocaleTimeString is 12-hour
    # ("3:04:05 PM").
    def moved():
        for c in lab.get("/v1/connections?limit=20")["items"]:
            r = lab.http.post(lab.url + f"/v1/connections/{c['id']}/migrate", json={}, timeout=10)
            if r.status_code in (200, 201, 202):
                return r.json()["id"]
        return None
    mid = wait_for("a connection to start migrating", moved, 30)

    def done():
        for m in lab.get("/v1/migrations?order=desc&limit=1000")["items"]:
            if m["id"] == mid and m["outcome"] != "in_progress" and m["phases"].get("import_us") is not None:
                return m
        return None
    m = wait_for(f"migration {mid} to finish with its import time", done, 30)
    assert m["outcome"] == "succeeded", m
    assert m["phases"]["export_us"] > 0 and m["phases"]["import_us"] > 0, m["phases"]

    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, locale="en-US", timezone_id="UTC")
    ctx.set_default_timeout(30_000)
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        login(page, lab)
        row = page.get_by_test_id(f"migration-row-{mid}")
        expect(row).to_be_visible()
        ms = m["started_unix_ms"]
        want = time.strftime("%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}"
        expect(row.get_by_test_id("migration-started")).to_have_text(want)
        expect(row.get_by_test_id("migration-started")).to_have_text(re.compile(r"^([01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d{3}$"))
        nonzero = re.compile(r"^([1-9]\d* µs|\d+\.\d+ m?s)$")
        for phase in ("export", "import"):
            cell = row.get_by_test_id(f"migration-{phase}")
            expect(cell).to_have_text(nonzero)
            expect(cell).not_to_have_text("0 µs")
        shot(page, "lab-09-migration-feed-phases")
    finally:
        ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"


# A client in the lab's client namespace holding one keep-alive HTTP
# connection to the VIP: it sends a request at start and at each "again"
# line on stdin, and prints "OK <status line> <server>" per answer.
HOLD_CONNECTION = r"""
import re, socket, sys
s = socket.create_connection(("198.18.100.1", 80), timeout=10)
def get():
    s.sendall(b"GET / HTTP/1.1\r\nHost: demo\r\n\r\n")
    buf = b""
    while b"</p>" not in buf:
        d = s.recv(4096)
        if not d:
            print("CLOSED", flush=True)
            sys.exit(1)
        buf += d
    m = re.search(rb"Served by <b>(s\d+)</b>", buf)
    print("OK", buf.split(b"\r\n")[0].decode(), m.group(1).decode() if m else "?", flush=True)
get()
for line in sys.stdin:
    if line.strip() == "again":
        get()
s.close()
"""


def retiring_entry(lab: DemoLab, name: str):
    for r in lab.get("/v1/services").get("retiring") or []:
        if r["name"] == name:
            return r
    return None


def test_a_deleted_service_retires_on_the_services_page_until_its_connections_end(page: Page, lab: DemoLab, shot):
    # Last in this file: it deletes the demo's service (and creates it again
    # at the end). An operator deletes `web` on the Services page while a
    # client holds a connection to it: the service leaves the list and
    # shows under Retiring with its connections left and the time since the
    # delete; the held connection is still answered; once it (and the demo
    # load's connections, whose round ends within CAPYBARA_DEMO_ROUND = 20 s)
    # closed, switchd removes the service and the Retiring entry goes.
    page.set_default_timeout(30_000)
    held = subprocess.Popen(
        ["ip", "netns", "exec", f"{lab.prefix}-c1", "python3", "-c", HOLD_CONNECTION],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        first = held.stdout.readline().strip()
        assert first.startswith("OK HTTP/1.1 200"), first
        login(page, lab)
        page.get_by_test_id("nav-services").click()
        expect(page.get_by_test_id("service-row-web")).to_be_visible()
        expect(page.get_by_test_id("retiring-section")).to_have_count(0)
        page.once("dialog", lambda d: d.accept())
        page.get_by_test_id("service-delete-web").click()
        expect(page.get_by_test_id("service-row-web")).to_have_count(0, timeout=10_000)

        # Retiring, with its connections counted (ours among them): in the
        # API (switchd's /status) within a few seconds, then on the page
        # (re-listed every 2 s).
        r = wait_for("web to be listed as retiring with its connections counted",
                     lambda: (lambda e: e if e and e.get("connections") else None)(retiring_entry(lab, "web")), 15)
        assert r["vip"] == "198.18.100.1" and r["port"] == 80 and r["connections"] >= 1, r
        assert "timeout_in_ms" not in r or r["timeout_in_ms"] <= 300_000, r
        row = page.get_by_test_id("retiring-row-web")
        expect(row).to_be_visible(timeout=10_000)
        expect(row).to_contain_text("198.18.100.1:80")
        expect(page.get_by_test_id("retiring-connections-web")).to_have_text(re.compile(r"^[1-9]\d*$"), timeout=10_000)
        expect(page.get_by_test_id("retiring-for-web")).to_have_text(re.compile(r"^\d+(s|m \d+s|h \d+m) ago$"))
        # Deleted is deleted: the name itself is 404 while it retires.
        resp = lab.http.get(lab.url + "/v1/services/web", timeout=10)
        assert resp.status_code == 404, resp.text
        shot(page, "lab-07-retiring")

        # The open connection is still served while the service retires.
        held.stdin.write("again\n")
        held.stdin.flush()
        again = held.stdout.readline().strip()
        assert again.startswith("OK HTTP/1.1 200"), again
    finally:
        if held.poll() is None:
            held.stdin.close()
            try:
                held.wait(10)
            except subprocess.TimeoutExpired:
                held.kill()
                held.wait(10)

    # Our connection closed; the demo load's end with its round: switchd
    # removes the service and the page no longer lists it as retiring.
    expect(page.get_by_test_id("retiring-row-web")).to_have_count(0, timeout=90_000)
    expect(page.get_by_test_id("retiring-section")).to_have_count(0)
    assert retiring_entry(lab, "web") is None
    assert not any(s.get("retiring") for s in lab.switchd_status()["services"])

    # Back as it was for whatever runs next: the demo's service again.
    r = lab.http.post(lab.url + "/v1/services", json={"name": "web", "vip": "198.18.100.1", "port": 80, "pool": []}, timeout=10)
    assert r.status_code == 201, r.text
    expect(page.get_by_test_id("service-serving-web").locator("[data-served='true']")).to_be_visible(timeout=10_000)
    shot(page, "lab-08-retired")
