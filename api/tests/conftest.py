"""Fixtures: a real capybara-api process on 127.0.0.1 (free port) with a real
SQLite store in a temp dir, and the generated Python client.

The server binary is $CAPYBARA_API_BIN (default: the debug build in
$CARGO_TARGET_DIR or target/). Every server a test starts is stopped by
the fixture, even when the test fails.
"""

import os
import pathlib
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "clients" / "python"))

import capybara_client  # noqa: E402


def api_bin() -> str:
    if os.environ.get("CAPYBARA_API_BIN"):
        return os.environ["CAPYBARA_API_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", str(HERE.parent.parent / "target"))
    return str(pathlib.Path(target) / "debug" / "capybara-api")


class ApiServer:
    """One capybara-api process; `restart()` keeps its store files."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.store = workdir / "store.db"
        self.token_file = workdir / "admin.token"
        self.proc = None
        self.url = None

    def start(self):
        self.proc = subprocess.Popen(
            [api_bin(), "--store", f"sqlite:{self.store}", "--listen", "127.0.0.1:0",
             "--admin-token-file", str(self.token_file), "--workers", "1"],
            stdout=subprocess.PIPE, stderr=open(self.workdir / "server.log", "ab"), text=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("listening on "):
                self.url = line.split()[-1].strip()
                return self
        self.stop()
        raise RuntimeError(f"capybara-api did not start; see {self.workdir / 'server.log'}")

    @property
    def admin_token(self) -> str:
        return self.token_file.read_text().strip()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def restart(self):
        self.stop()
        return self.start()

    def client(self, token=None) -> capybara_client.ApiClient:
        cfg = capybara_client.Configuration(host=self.url, access_token=token or self.admin_token)
        return capybara_client.ApiClient(cfg)


@pytest.fixture
def server(tmp_path):
    s = ApiServer(tmp_path).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def admin(server):
    with server.client() as c:
        yield c


def make_token(server, role: str, name: str) -> str:
    with server.client() as c:
        t = capybara_client.TokensApi(c).create_token(capybara_client.TokenRequest(name=name, role=role))
        return t.secret
