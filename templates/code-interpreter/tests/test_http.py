"""The wire protocol (raw HTTP, parsed with the SDK's own
e2b_code_interpreter.models.parse_output where it is a stream), refusals of
bad input, and the bounds."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from e2b import SandboxException
from e2b_code_interpreter.models import Execution, parse_output

from conftest import make_sandbox


def stream_lines(server, body, timeout=60):
    with httpx.stream("POST", server.url + "/execute", json=body, timeout=timeout) as res:
        assert res.status_code == 200, res.read()
        assert res.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in res.iter_lines()]


def test_health_says_ok(server):
    res = httpx.get(server.url + "/health")
    assert res.status_code == 200 and res.json() == "OK"


def test_execute_stream_shape(server):
    lines = stream_lines(server, {"code": "print('hi')\n6 * 7"})
    kinds = [l["type"] for l in lines]
    assert kinds[0] == "number_of_executions" and isinstance(lines[0]["execution_count"], int)
    assert kinds[-1] == "end_of_execution"
    out = next(l for l in lines if l["type"] == "stdout")
    assert out["text"] == "hi\n" and isinstance(out["timestamp"], str)
    res = next(l for l in lines if l["type"] == "result")
    assert res == {"type": "result", "text": "42", "is_main_result": True}
    # The SDK's own parser takes every line.
    execution = Execution()
    for line in lines:
        parse_output(execution, json.dumps(line))
    assert execution.text == "42" and execution.logs.stdout == ["hi\n"]


def test_a_silent_execution_sends_keepalives_the_sdk_ignores(server, sandbox):
    lines = stream_lines(server, {"code": "import time; time.sleep(6.5); 'done'"})
    assert {"type": "keepalive"} in lines
    assert lines[-1] == {"type": "end_of_execution"}
    assert sandbox.run_code("import time; time.sleep(5.5); 'done'").text == "done"


@pytest.mark.parametrize(
    "method,path,body,status,code",
    [
        ("GET", "/nope", None, 404, "not_found"),
        ("GET", "/execute", None, 405, "method_not_allowed"),
        ("POST", "/execute", b"{not json", 400, "invalid_json"),
        ("POST", "/execute", b"[1]", 400, "invalid_json"),
        ("POST", "/execute", b'{"language": "python"}', 400, "invalid_request"),
        ("POST", "/execute", b'{"code": 5}', 400, "invalid_request"),
        ("POST", "/execute", b'{"code": "1", "context_id": "x", "language": "python"}', 400, "invalid_request"),
        ("POST", "/execute", b'{"code": "1", "env_vars": {"A": 1}}', 400, "invalid_request"),
        ("POST", "/execute", b'{"code": "1", "env_vars": {"A=B": "1"}}', 400, "invalid_request"),
        ("POST", "/execute", b'{"code": "1", "context_id": "missing"}', 404, "context_not_found"),
        ("POST", "/execute", b'{"code": "1", "language": "r"}', 400, "unsupported_language"),
        ("POST", "/contexts", b'{"cwd": "/definitely/not/here"}', 400, "invalid_cwd"),
        ("POST", "/contexts", b'{"language": "java"}', 400, "unsupported_language"),
        ("DELETE", "/contexts/missing", None, 404, "context_not_found"),
        ("POST", "/contexts/missing/restart", None, 404, "context_not_found"),
    ],
)
def test_bad_requests_are_refused_with_a_code(server, method, path, body, status, code):
    before = httpx.get(server.url + "/contexts").json()
    res = httpx.request(method, server.url + path, content=body, headers={"Content-Type": "application/json"})
    assert res.status_code == status, res.text
    assert res.json()["code"] == code and res.json()["message"]
    assert httpx.get(server.url + "/contexts").json() == before


def test_a_body_over_the_limit_is_refused(server):
    res = httpx.post(server.url + "/execute", content=b" " * ((32 << 20) + 1), timeout=60)
    assert res.status_code == 413 and res.json()["code"] == "body_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_number_of_contexts_is_bounded(start_server, monkeypatch):
    srv = start_server("--max-contexts", "2")
    sandbox = make_sandbox(srv.url, monkeypatch)
    extra = sandbox.create_code_context()  # the default context is the first
    with pytest.raises(SandboxException) as info:
        sandbox.create_code_context()
    assert "429" in str(info.value) and "too_many_contexts" in str(info.value)
    assert len(sandbox.list_code_contexts()) == 2
    sandbox.remove_code_context(extra)
    again = sandbox.create_code_context()
    assert sandbox.run_code("1", context=again).text == "1"


def test_an_output_over_the_line_limit_is_truncated_and_the_call_ends(sandbox):
    execution = sandbox.run_code("print('x' * (40 << 20))\n'after'", timeout=120)
    out = "".join(execution.logs.stdout)
    assert "[strata: output truncated" in out
    assert len(out) < (33 << 20)
    assert execution.text == "after"
    big = sandbox.run_code("'y' * (40 << 20)", timeout=120)
    assert big.text.startswith("[strata: result of") and big.results[0].is_main_result


def test_a_kernel_message_over_the_zmq_limit_is_dropped_and_the_call_still_ends(sandbox):
    t0 = time.monotonic()
    execution = sandbox.run_code("print('z' * (80 << 20))\n'lost too'", timeout=120)
    assert time.monotonic() - t0 < 60
    assert execution.error is not None and execution.error.name == "OutputLost"
    assert len("".join(execution.logs.stdout)) < (33 << 20)
    # The next call has its outputs again (a fresh kernel client), same kernel.
    assert sandbox.run_code("'still here'").text == "still here"
    assert sandbox.run_code("'lost too' in Out.values()").text == "True"


def test_a_kernel_that_dies_is_restarted_and_says_so(sandbox):
    ctx = sandbox.create_code_context()
    try:
        sandbox.run_code("doomed = 1", context=ctx)
        died = sandbox.run_code("import os; os._exit(3)", context=ctx, timeout=60)
        assert died.error is not None and died.error.name == "ContextRestarting"
        fresh = sandbox.run_code("'doomed' in globals()", context=ctx)
        assert fresh.text == "False"
    finally:
        sandbox.remove_code_context(ctx)


def test_cors_preflight_is_answered(server):
    res = httpx.options(server.url + "/execute")
    assert res.status_code == 204
    assert res.headers["access-control-allow-origin"] == "*"


def test_a_kernel_killed_between_executions_is_restarted_and_runs_the_code(sandbox):
    ctx = sandbox.create_code_context()
    try:
        pid = int(sandbox.run_code("import os; os.getpid()", context=ctx).text)
        sandbox.run_code("lost_state = 1", context=ctx)
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        time.sleep(0.5)
        ran = sandbox.run_code("import os; (os.getpid(), 'lost_state' in globals())", context=ctx, timeout=60)
        assert ran.error is None, ran.error
        new_pid, kept = eval(ran.text)
        assert new_pid != pid and kept is False
    finally:
        sandbox.remove_code_context(ctx)


def test_health_is_not_ok_before_the_default_kernel_is_warm(tmp_path):
    # The template's ready check is GET /health: it must not pass while the
    # default kernel is still starting, or the snapshot would hold a cold one.
    from conftest import SERVER, _free_port

    port = _free_port()
    (tmp_path / "home").mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(port), "--cwd", str(tmp_path / "home"),
         "--env-file", str(tmp_path / "envs.json")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        statuses = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                res = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            statuses.append((res.status_code, res.json()))
            if res.status_code == 200:
                break
            time.sleep(0.05)
        assert statuses[0][0] == 503 and statuses[0][1]["code"] == "starting", statuses[:3]
        assert statuses[-1] == (200, "OK")
        # Once OK, the default context answers at once, with its imports loaded.
        t0 = time.monotonic()
        lines = [json.loads(l) for l in httpx.post(url + "/execute", json={"code": "import sys; 'numpy' in sys.modules"}).text.splitlines()]
        assert time.monotonic() - t0 < 2
        assert {"type": "result", "text": "True", "is_main_result": True} in lines
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_refused_request_with_an_unread_body_does_not_poison_the_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        body = b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n'  # would be read as a second request
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.settimeout(10)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 405")
    assert data.count(b"HTTP/1.1 ") == 1, data  # one answer, then the server closed
