"""Sandbox logs through the unmodified e2b SDK's own API client (the SDK has
no public wrapper for them): `GET /v2/sandboxes/{id}/logs` and
`GET /sandboxes/{id}/logs`, answered from the daemon's process log — what
the sandbox's commands printed, one entry per line with a level."""

from e2b import Sandbox
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, SandboxLogsV2Response, SandboxLogs
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig


def _client():
    return get_api_client(ConnectionConfig())


def test_command_output_shows_in_the_sandbox_logs(sbx: Sandbox):
    r = sbx.commands.run("echo logged-out-$((6*7)); echo logged-err >&2; exit 0")
    assert r.stdout == "logged-out-42\n"
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(sbx.sandbox_id, client=_client())
    assert res.status_code == 200, res.content
    assert isinstance(res.parsed, SandboxLogsV2Response)
    msgs = [(e.level, e.message) for e in res.parsed.logs]
    assert (LogLevel.INFO, "logged-out-42") in msgs
    assert (LogLevel.ERROR, "logged-err") in msgs
    assert any(m.startswith("started: ") and "logged-out" in m for _, m in msgs)
    # Only errors, filtered by text.
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
        sbx.sandbox_id, client=_client(), level=LogLevel.ERROR, search="logged"
    )
    assert [e.message for e in res.parsed.logs] == ["logged-err"]
    # The v1 form: lines and entries.
    res = get_sandboxes_sandbox_id_logs.sync_detailed(sbx.sandbox_id, client=_client())
    assert res.status_code == 200, res.content
    assert isinstance(res.parsed, SandboxLogs)
    assert "logged-out-42" in [l.line for l in res.parsed.logs]
    assert len(res.parsed.log_entries) == len(res.parsed.logs)


def test_logs_of_an_unknown_sandbox_are_404():
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed("sb-000000000000", client=_client())
    assert res.status_code == 404
