"""Per-sandbox port settings with the unmodified SDK and httpx:
`network={"allow_public_traffic": False}` makes the sandbox's guest ports
answer 403 without a credential and 200 with its `traffic_access_token`
(the daemon's own default is public); `mask_request_host` is the Host the
guest server sees; a fork keeps both; bad masks are 400."""

import time

import httpx
import pytest
from e2b import Sandbox, SandboxNetworkOpts
from e2b.exceptions import InvalidArgumentException, SandboxException

from conftest import SUITE

PORT = 8081

# A server that answers every GET with the Host header it received.
SERVER = f"""python3 -c "
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = self.headers.get('Host', '').encode()
        self.send_response(200)
        self.send_header('X-Names', ','.join(self.headers.keys()))
        self.send_header('Content-Length', str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(('127.0.0.1', {PORT}), H).serve_forever()
" """


def _serve(sbx):
    sbx.commands.run(SERVER, background=True)
    r = sbx.commands.run(
        "for i in $(seq 1 100); do python3 -c \"import socket; "
        f"socket.create_connection(('127.0.0.1', {PORT})).close()\" 2>/dev/null "
        "&& echo up && exit 0; sleep 0.2; done; echo down"
    )
    assert r.stdout.strip() == "up"


def _get(url, headers=None):
    return httpx.get(url, headers=headers or {}, timeout=60)


@pytest.fixture(scope="module")
def private():
    s = Sandbox.create(
        metadata={"suite": SUITE, "role": "port-settings"},
        timeout=600,
        network=SandboxNetworkOpts(
            allow_public_traffic=False,
            mask_request_host="custom-host.example.com:${PORT}",
        ),
    )
    _serve(s)
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_a_private_sandbox_needs_its_traffic_token(private):
    url = f"http://{private.get_host(PORT)}/"
    assert _get(url).status_code == 403
    token = private.traffic_access_token
    assert token
    r = _get(url, {"e2b-traffic-access-token": token})
    assert r.status_code == 200, r.text
    assert _get(url, {"e2b-traffic-access-token": "wrong"}).status_code == 401


def test_the_guest_sees_the_masked_host(private):
    url = f"http://{private.get_host(PORT)}/"
    r = _get(url, {"e2b-traffic-access-token": private.traffic_access_token})
    assert r.status_code == 200
    assert r.text == f"custom-host.example.com:{PORT}"
    # Header names reach the guest in their canonical case, as E2B's proxy
    # sends them (a server that reads `Host:` literally finds it).
    names = r.headers["x-names"].split(",")
    assert "Host" in names and "User-Agent" in names, names


def test_the_shared_sandbox_stays_public(sbx):
    _serve(sbx)
    r = _get(f"http://{sbx.get_host(PORT)}/")
    assert r.status_code == 200
    # No mask: the guest sees the routed host.
    assert r.text == sbx.get_host(PORT)


def test_a_fork_of_a_private_sandbox_is_private(private):
    forks = private.fork(timeout=120)
    assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
    f = forks[0]
    try:
        url = f"http://{f.get_host(PORT)}/"
        # The fork runs the parent's server (its memory was forked).
        deadline = time.time() + 30
        while True:
            r = _get(url, {"e2b-traffic-access-token": f.traffic_access_token})
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.text == f"custom-host.example.com:{PORT}"
        assert _get(url).status_code == 403
    finally:
        f.kill()


def test_a_bad_mask_is_refused():
    with pytest.raises((InvalidArgumentException, SandboxException)) as e:
        Sandbox.create(
            metadata={"suite": SUITE},
            network=SandboxNetworkOpts(mask_request_host="bad host\r\nX: 1"),
        )
    assert "maskRequestHost" in str(e.value)
