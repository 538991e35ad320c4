"""Fixtures: the real server (../server.py) on a free loopback port, with real
ipykernel kernels, driven by the unmodified e2b-code-interpreter SDK.

The SDK's Sandbox is built with its own (deprecated but public) constructor
instead of `Sandbox.create()`, so no E2B API is involved: E2B_SANDBOX_URL
points the SDK at the server, as a self-hoster sets it, and every call
(`run_code`, `create_code_context`, ...) is the SDK's own code.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
# STRATA_INTERP_SERVER: another copy of the server (e.g. a mutated one, to see a test fail).
SERVER = Path(os.environ.get("STRATA_INTERP_SERVER") or HERE.parent / "server.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cwd = tmp / "home"
        self.cwd.mkdir()
        self.log = open(tmp / "server.log", "w+b")
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(self.port), "--cwd", str(self.cwd), "--env-file", str(tmp / "envs.json"), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in 120 s: {self.logs()}")
            time.sleep(0.2)

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def make_sandbox(url, monkeypatch):
    """The SDK's own Sandbox class, pointed at `url` through E2B_SANDBOX_URL."""
    from e2b import ConnectionConfig
    from e2b_code_interpreter import Sandbox
    from packaging.version import Version

    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_unused")
    return Sandbox(
        sandbox_id="strata-local",
        sandbox_domain=None,
        envd_version=Version("0.5.0"),
        envd_access_token=None,
        traffic_access_token=None,
        connection_config=ConnectionConfig(),
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("interp"))
    yield srv
    srv.stop()


@pytest.fixture
def sandbox(server, monkeypatch):
    return make_sandbox(server.url, monkeypatch)


@pytest.fixture
def start_server(tmp_path):
    """A server of the test's own (other flags); stopped at the end of the test."""
    started = []

    def start(*args):
        srv = Server(tmp_path, *args)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
