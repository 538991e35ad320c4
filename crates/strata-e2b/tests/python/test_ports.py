"""Guest ports with the unmodified SDK and httpx: `get_host(port)` is
`<port>-<id>.<domain>` with the create answer's domain (`localhost:<daemon
port>`: glibc resolves it once scripts/setup.sh added `myhostname` to
/etc/nsswitch.conf), and the E2B_SANDBOX_URL form (`E2b-Sandbox-Id` +
`E2b-Sandbox-Port` on every request). A hibernated (paused) sandbox wakes
on port traffic."""

import os
import socket
import time
import urllib.parse

import httpx
import pytest
from e2b import Sandbox

from conftest import SUITE

PORT = 8000
BODY = "port test body\n"


def _start_server(sbx, port=PORT):
    sbx.files.write("/tmp/www/hello.txt", BODY)
    sbx.commands.run(
        f"cd /tmp/www && python3 -m http.server {port} --bind 127.0.0.1",
        background=True,
    )
    r = sbx.commands.run(
        "for i in $(seq 1 100); do python3 -c \"import socket; "
        f"socket.create_connection(('127.0.0.1', {port})).close()\" 2>/dev/null "
        "&& echo up && exit 0; sleep 0.2; done; echo down"
    )
    assert r.stdout.strip() == "up"


@pytest.fixture(scope="module")
def served(sbx):
    _start_server(sbx)
    return sbx


def test_get_host_names_a_routable_host(served):
    api = urllib.parse.urlparse(os.environ["E2B_API_URL"])
    host = served.get_host(PORT)
    assert host == f"{PORT}-{served.sandbox_id}.localhost:{api.port}"
    name = host.rsplit(":", 1)[0]
    try:
        socket.getaddrinfo(name, api.port)
    except socket.gaierror as e:
        pytest.fail(f"{name} does not resolve ({e}): run scripts/setup.sh (myhostname)")
    r = httpx.get(f"http://{host}/hello.txt", timeout=60)
    assert r.status_code == 200
    assert r.text == BODY
    # A directory listing: an ordinary page of the guest's server.
    r = httpx.get(f"http://{host}/", timeout=60)
    assert r.status_code == 200 and "hello.txt" in r.text


def test_requests_by_sandbox_headers(served):
    url = os.environ["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": served.sandbox_id, "E2b-Sandbox-Port": str(PORT)}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        r = c.get("/hello.txt")
        assert r.status_code == 200 and r.text == BODY
        # Paths the daemon serves itself go to the guest as well.
        assert c.get("/health").status_code == 404
        missing = c.get("/hello.txt", headers={"E2b-Sandbox-Port": "8999"})
        assert missing.status_code == 502
        assert missing.json()["port"] == 8999


def test_traffic_token_is_checked(served):
    host = served.get_host(PORT)
    token = served.traffic_access_token
    assert token
    ok = httpx.get(
        f"http://{host}/hello.txt",
        headers={"e2b-traffic-access-token": token},
        timeout=60,
    )
    assert ok.status_code == 200
    bad = httpx.get(
        f"http://{host}/hello.txt",
        headers={"e2b-traffic-access-token": "0" * 64},
        timeout=60,
    )
    assert bad.status_code == 401


def test_port_traffic_wakes_a_paused_sandbox():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "ports-wake"}, timeout=600)
    try:
        _start_server(s)
        host = s.get_host(PORT)
        assert s.pause() is True
        assert s.get_info().state.value == "paused"
        t = time.monotonic()
        r = httpx.get(f"http://{host}/hello.txt", timeout=120)
        assert r.status_code == 200 and r.text == BODY
        print(f"wake on port traffic: {time.monotonic() - t:.2f}s")
        assert s.get_info().state.value == "running"
    finally:
        s.kill()
