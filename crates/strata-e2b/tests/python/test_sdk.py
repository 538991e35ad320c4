"""The unmodified `e2b` SDK against strata (real daemon, real guests)."""

import os
import time

import pytest
from e2b import Sandbox
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.commands.command_handle import CommandExitException

from conftest import SUITE


def test_run_stdout_stderr_exit_code(sbx):
    r = sbx.commands.run("echo hello; echo oops >&2")
    assert r.exit_code == 0
    assert r.stdout == "hello\n"
    assert r.stderr == "oops\n"


def test_nonzero_exit_raises(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo partial; exit 7")
    assert ei.value.exit_code == 7
    assert ei.value.stdout == "partial\n"


def test_envs_and_cwd(sbx):
    r = sbx.commands.run("echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n"


def test_streaming_callbacks(sbx):
    out, err = [], []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.2; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "out1\nout2\nout3\n"
    assert "".join(err) == "err1\nerr2\nerr3\n"
    assert r.exit_code == 0


def test_background_command_list_and_kill(sbx):
    h = sbx.commands.run("sleep 600", background=True)
    assert h.pid > 1
    pids = [p.pid for p in sbx.commands.list()]
    assert h.pid in pids
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_stdin(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    sbx.commands.send_stdin(h.pid, "stdin\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello stdin\n"
    assert r.exit_code == 0


def test_connect_to_running_command(sbx):
    h = sbx.commands.run("sleep 1; echo late", background=True)
    h2 = sbx.commands.connect(h.pid)
    r = h2.wait()
    assert r.stdout == "late\n"
    h.wait()


def test_files(sbx):
    info = sbx.files.write("/tmp/e2b-test/dir/a.txt", "hello file")
    assert info.path == "/tmp/e2b-test/dir/a.txt"
    assert info.name == "a.txt"
    assert sbx.files.read("/tmp/e2b-test/dir/a.txt") == "hello file"
    assert sbx.files.read("/tmp/e2b-test/dir/a.txt", format="bytes") == bytearray(b"hello file")
    sbx.files.write("/tmp/e2b-test/bin.dat", bytes(range(256)))
    assert bytes(sbx.files.read("/tmp/e2b-test/bin.dat", format="bytes")) == bytes(range(256))
    assert sbx.files.exists("/tmp/e2b-test/dir/a.txt")
    assert not sbx.files.exists("/tmp/e2b-test/missing")
    names = sorted(e.name for e in sbx.files.list("/tmp/e2b-test"))
    assert names == ["bin.dat", "dir"]
    deep = sorted(e.path for e in sbx.files.list("/tmp/e2b-test", depth=2))
    assert "/tmp/e2b-test/dir/a.txt" in deep
    assert sbx.files.make_dir("/tmp/e2b-test/new/sub") is True
    assert sbx.files.make_dir("/tmp/e2b-test/new/sub") is False
    st = sbx.files.get_info("/tmp/e2b-test/dir/a.txt")
    assert st.size == len("hello file")
    assert st.type.value == "file"
    sbx.files.rename("/tmp/e2b-test/dir/a.txt", "/tmp/e2b-test/b.txt")
    assert sbx.files.read("/tmp/e2b-test/b.txt") == "hello file"
    sbx.files.remove("/tmp/e2b-test/b.txt")
    assert not sbx.files.exists("/tmp/e2b-test/b.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/e2b-test/b.txt")
    # The files are the guest's: a command sees them.
    assert sbx.commands.run("cat /tmp/e2b-test/bin.dat | wc -c").stdout.strip() == "256"


def test_get_info_and_list_with_metadata(sbx):
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.metadata.get("suite") == SUITE
    assert info.state.value == "running"
    assert info.cpu_count >= 1 and info.memory_mb >= 64
    listed = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": SUITE, "role": "shared"}))
    items = listed.next_items()
    assert [s.sandbox_id for s in items] == [sbx.sandbox_id]
    none = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"suite": "no-such-suite"}))
    assert none.next_items() == []


def test_set_timeout(sbx):
    before = sbx.get_info().end_at
    sbx.set_timeout(3600)
    after = sbx.get_info().end_at
    assert after > before
    sbx.set_timeout(600)


def test_pause_and_connect_keeps_processes_and_files():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "pause"}, timeout=600)
    try:
        s.files.write("/root/kept.txt", "still here")
        h = s.commands.run("sleep 900", background=True)
        assert s.pause() is True
        assert s.get_info().state.value == "paused"
        assert Sandbox.pause(s.sandbox_id) is False  # already paused: 409
        s2 = Sandbox.connect(s.sandbox_id)
        assert s2.get_info().state.value == "running"
        assert s2.files.read("/root/kept.txt") == "still here"
        # The process survived the hibernation (memory was kept).
        assert s2.commands.run(f"kill -0 {h.pid} && echo alive").stdout == "alive\n"
        assert h.pid in [p.pid for p in s2.commands.list()]
        assert s2.commands.kill(h.pid) is True
    finally:
        assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_wrong_api_key():
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_wrong_key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_wrong_key").next_items()


def test_unknown_sandbox_is_not_found():
    unknown = "sbx-doesnotexist0000"
    with pytest.raises(NotFoundException):
        Sandbox.connect(unknown)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(unknown)
    assert Sandbox.kill(unknown) is False


def test_wrong_envd_token_is_refused(sbx):
    import httpx

    r = httpx.post(
        os.environ["E2B_SANDBOX_URL"] + "/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"},
    )
    assert r.status_code == 401
    assert r.json()["code"] == "unauthenticated"


def test_same_sandbox_in_strata_api(sbx):
    """A sandbox made through E2B is a strata sandbox: strata's own API
    lists it with its metadata as labels and can snapshot it."""
    import httpx

    base = os.environ["E2B_API_URL"]
    auth = {"Authorization": f"Bearer {os.environ.get('STRATA_TOKEN', '')}"}
    r = httpx.get(f"{base}/v1/sandboxes/{sbx.sandbox_id}", headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["labels"]["suite"] == SUITE
    r = httpx.post(f"{base}/v1/sandboxes/{sbx.sandbox_id}/snapshots", json={"label": "from-e2b"}, headers=auth, timeout=120)
    assert r.status_code < 300, r.text
    # And the sandbox keeps working through E2B afterwards.
    assert sbx.commands.run("echo ok").stdout == "ok\n"


def test_watch_dir(sbx):
    sbx.files.make_dir("/tmp/watched")
    sbx.files.write("/tmp/watched/old.txt", "x")
    h = sbx.files.watch_dir("/tmp/watched")
    sbx.files.write("/tmp/watched/new.txt", "hello")
    sbx.files.remove("/tmp/watched/old.txt")
    events = {(e.name, e.type.value) for e in h.get_new_events()}
    assert ("new.txt", "create") in events
    assert ("old.txt", "remove") in events
    assert h.get_new_events() == []
    h.stop()


# ------------------------------------------------- strata tokens, tenancy, policy


def _strata(method, path, **kw):
    """A call to strata's own API as the bootstrap admin (STRATA_TOKEN)."""
    import httpx

    headers = {"Authorization": f"Bearer {os.environ['STRATA_TOKEN']}"}
    headers.update(kw.pop("headers", {}))
    return httpx.request(method, os.environ["E2B_API_URL"] + path, headers=headers, timeout=60, **kw)


def _token(role, tenant=None):
    body = {"role": role, "name": f"e2b-test-{role}"}
    if tenant:
        body["tenant"] = tenant
    r = _strata("POST", "/v1/tokens", json=body)
    assert r.status_code in (200, 201), r.text
    return r.json()["token"]


def test_strata_token_as_api_key(sbx):
    """A strata developer token works as E2B_API_KEY (its tenant: default,
    the shared sandbox's); a viewer token may only read."""
    dev = _token("developer")
    assert Sandbox.get_info(sbx.sandbox_id, api_key=dev).sandbox_id == sbx.sandbox_id
    s = Sandbox.create(api_key=dev, metadata={"suite": SUITE, "role": "token"}, timeout=120)
    try:
        assert s.commands.run("echo via-token").stdout == "via-token\n"
        r = _strata("GET", f"/v1/sandboxes/{s.sandbox_id}")
        assert r.status_code == 200, r.text
        assert r.json().get("tenant", "default") == "default", r.text
    finally:
        s.kill()
    viewer = _token("viewer")
    assert Sandbox.get_info(sbx.sandbox_id, api_key=viewer).sandbox_id == sbx.sandbox_id
    with pytest.raises(Exception) as e:
        Sandbox.create(api_key=viewer)
    assert "may only read" in str(e.value) or "403" in str(e.value), e.value
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="strata_" + "0" * 64).next_items()


def test_other_tenant_sees_not_found(sbx):
    other = _token("developer", tenant="e2b-other")
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, api_key=other)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, api_key=other)
    assert Sandbox.kill(sbx.sandbox_id, api_key=other) is False
    listed = Sandbox.list(api_key=other).next_items()
    assert sbx.sandbox_id not in [x.sandbox_id for x in listed]
    # Still alive for its own tenant.
    assert sbx.commands.run("echo still").stdout == "still\n"


POLICY = """
[[rule]]
id = "no-rm"
effect = "deny"
kind = "exec"
program = "rm"
reason = "no deleting through commands"

[[rule]]
id = "locked-dir"
effect = "deny"
kind = "file_write"
path = "/tmp/locked/**"
reason = "read-only area"
"""


def test_policy_applies_to_envd_calls(sbx):
    r = _strata("PUT", f"/v1/sandboxes/{sbx.sandbox_id}/policy", content=POLICY,
                headers={"Content-Type": "application/toml"})
    assert r.status_code == 200, r.text
    try:
        # exec: the SDK sends `/bin/bash -l -c CMD`; the shell reading sees rm.
        with pytest.raises(Exception) as e:
            sbx.commands.run("rm -f /tmp/x")
        assert "no-rm" in str(e.value), e.value
        assert sbx.commands.run("echo allowed").stdout == "allowed\n"
        # file writes: upload and make_dir under the locked directory.
        with pytest.raises(Exception) as e:
            sbx.files.write("/tmp/locked/a.txt", "x")
        assert "locked-dir" in str(e.value), e.value
        with pytest.raises(Exception) as e:
            sbx.files.make_dir("/tmp/locked/sub")
        assert "locked-dir" in str(e.value), e.value
        sbx.files.write("/tmp/free.txt", "ok")
        assert sbx.files.read("/tmp/free.txt") == "ok"
        # The audit log has the denials, attributed to the sandbox.
        r = _strata("GET", f"/v1/audit?sandbox={sbx.sandbox_id}")
        assert r.status_code == 200, r.text
        import json

        entries = [json.loads(line) for line in r.text.splitlines() if line.strip()]

        def kind(e):
            k = e["call"]["kind"]
            return k["kind"] if isinstance(k, dict) else k

        denied = {(kind(e), e["decision"]["rule_id"]) for e in entries
                  if e["decision"]["outcome"] == "denied"}
        assert ("exec", "no-rm") in denied, denied
        assert ("file_write", "locked-dir") in denied, denied
        assert any(kind(e) == "exec" and e["decision"]["outcome"] == "allowed" for e in entries)
    finally:
        r = _strata("PUT", f"/v1/sandboxes/{sbx.sandbox_id}/policy", content='default = "allow"\n',
                    headers={"Content-Type": "application/toml"})
        assert r.status_code == 200, r.text


# ------------------------------------------------- bounds and per-key tenants


def test_oversize_upload_is_refused_and_changes_nothing(sbx):
    """max_upload_bytes (run-python.sh sets STRATA_MAX_UPLOAD_BYTES) holds for
    the SDK's upload (octet-stream with a length: refused before reading) and
    for a chunked one (cut off as it streams); the guest keeps no partial
    file and an existing file keeps its content."""
    import httpx

    limit = int(os.environ["STRATA_MAX_UPLOAD_BYTES"])
    sbx.files.write("/tmp/e2b-big/keep.bin", b"old")
    with pytest.raises(Exception) as e:
        sbx.files.write("/tmp/e2b-big/keep.bin", b"x" * (limit + 1))
    assert "larger than" in str(e.value), e.value
    assert bytes(sbx.files.read("/tmp/e2b-big/keep.bin", format="bytes")) == b"old"

    def chunks():
        for _ in range(limit // (64 << 10) + 2):
            yield b"y" * (64 << 10)

    token = getattr(sbx, "_envd_access_token", None) or ""
    r = httpx.post(
        os.environ["E2B_SANDBOX_URL"] + "/files",
        params={"path": "/tmp/e2b-big/new.bin"},
        content=chunks(),
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token,
                 "Content-Type": "application/octet-stream"},
        timeout=120,
    )
    assert r.status_code == 413, r.text
    assert r.json()["code"] == 413
    assert not sbx.files.exists("/tmp/e2b-big/new.bin")
    sbx.files.write("/tmp/e2b-big/ok.bin", b"z" * limit)
    assert sbx.files.get_info("/tmp/e2b-big/ok.bin").size == limit


def test_refused_upload_leaves_no_temporary_file(sbx):
    """An upload the host gives up on is abandoned in the guest (agent
    protocol `write_abort`): no temporary file while the sandbox runs.
    The abort does not wait for an answer, and the guest removes the file
    once it has written what was queued, so a listing made at the same
    moment can still see it; within two seconds it is gone (a leak never
    goes)."""
    limit = int(os.environ["STRATA_MAX_UPLOAD_BYTES"])
    with pytest.raises(Exception):
        sbx.files.write("/tmp/e2b-tmp/a.bin", b"x" * (limit + 1))
    deadline = time.monotonic() + 2.0
    left = [e.name for e in sbx.files.list("/tmp/e2b-tmp")]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [e.name for e in sbx.files.list("/tmp/e2b-tmp")]
    assert left == []


def test_a_tenant_key_acts_for_its_tenant_and_actor():
    """run-python.sh configures E2B_TENANT_KEY as `KEY=acme:sdk-bot`."""
    key = os.environ["E2B_TENANT_KEY"]
    s = Sandbox.create(api_key=key, timeout=120)
    try:
        assert s.commands.run("echo acme").stdout == "acme\n"
        assert s.sandbox_id in [i.sandbox_id for i in Sandbox.list(api_key=key).next_items()]
        assert s.sandbox_id not in [i.sandbox_id for i in Sandbox.list().next_items()]
        viewer = _token("viewer", "acme")
        r = _strata("GET", f"/v1/sandboxes/{s.sandbox_id}", headers={"Authorization": f"Bearer {viewer}"})
        assert r.status_code == 200, r.text
        admin = _token("admin", "acme")
        r = _strata("GET", f"/v1/audit?sandbox={s.sandbox_id}", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200, r.text
        import json

        actors = {json.loads(line)["actor"] for line in r.text.splitlines() if line.strip()}
        assert actors == {"sdk-bot"}, actors
    finally:
        s.kill()


# ------------------------------------------- E2B's base-template conventions


def test_commands_run_as_user_by_default(sbx):
    """envd's rule: commands run as `user` in its home unless told otherwise."""
    r = sbx.commands.run("id -un; id -u; pwd; echo $HOME")
    assert r.stdout == "user\n1000\n/home/user\n/home/user\n", r.stdout
    r = sbx.commands.run("id -un; pwd", user="root")
    assert r.stdout == "root\n/root\n", r.stdout
    with pytest.raises(Exception):
        sbx.commands.run("true", user="-rf")


def test_files_act_as_root_and_give_new_paths_to_the_user(sbx):
    """As envd's EnsureDirs + Chown: a client creates /workspace (under /,
    which only root may write) and the user owns what was made."""
    sbx.files.make_dir("/workspace-e2b")
    sbx.files.write("/workspace-e2b/sub/dir/a.txt", "mine")
    r = sbx.commands.run(
        "stat -c '%U:%G %n' /workspace-e2b /workspace-e2b/sub /workspace-e2b/sub/dir "
        "/workspace-e2b/sub/dir/a.txt; touch /workspace-e2b/by-user && echo ok"
    )
    assert r.stdout.splitlines() == [
        "user:user /workspace-e2b",
        "user:user /workspace-e2b/sub",
        "user:user /workspace-e2b/sub/dir",
        "user:user /workspace-e2b/sub/dir/a.txt",
        "ok",
    ], r.stdout
    # Existing directories keep their owner; root's calls make root's files.
    assert sbx.commands.run("stat -c %U /tmp").stdout == "root\n"
    sbx.files.write("/tmp/e2b-root-owned.txt", "x", user="root")
    assert sbx.commands.run("stat -c %U /tmp/e2b-root-owned.txt").stdout == "root\n"


def test_relative_paths_are_in_the_users_home(sbx):
    sbx.files.write("rel-e2b.txt", "relative")
    assert sbx.commands.run("cat /home/user/rel-e2b.txt").stdout == "relative"
    assert sbx.files.read("rel-e2b.txt") == "relative"


def test_strata_token_in_e2b_key_format(sbx):
    """`e2b_` + the hex of a strata token is the same credential (E2B's SDKs
    check a key's prefix); the token's issue answer carries it."""
    body = {"role": "developer", "name": "e2b-test-keyformat"}
    r = _strata("POST", "/v1/tokens", json=body)
    assert r.status_code in (200, 201), r.text
    tok = r.json()
    key = tok["e2b_key"]
    assert key == "e2b_" + tok["token"][len("strata_"):], tok
    assert Sandbox.get_info(sbx.sandbox_id, api_key=key).sandbox_id == sbx.sandbox_id
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "0" * 64).next_items()


@pytest.mark.skipif(os.environ.get("STRATA_OLD_IMAGE") == "1", reason="image before recipe 2")
def test_base_template_tools_and_limits(sbx):
    """sudo without a password, python and pip, /dev/shm, /etc/hosts naming
    the sandbox, a UTF-8 locale, a usable open-file limit, multiprocessing."""
    r = sbx.commands.run(
        "sudo -n id -un; python --version; pip --version >/dev/null && echo pip; "
        "awk '$2==\"/dev/shm\"{print $3}' /proc/mounts; "
        "grep -w \"$(hostname)\" /etc/hosts | awk '{print $1}'; echo $LANG; ulimit -n"
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "root", r.stdout
    assert lines[1].startswith("Python 3"), r.stdout
    assert lines[2] == "pip", r.stdout
    assert lines[3] == "tmpfs", r.stdout
    assert lines[4] == "127.0.1.1", r.stdout
    assert lines[5] == "C.UTF-8", r.stdout
    assert int(lines[6]) >= 65536, r.stdout
    code = (
        "import multiprocessing as m\n"
        "def sq(x): return x * x\n"
        "if __name__ == '__main__':\n"
        "    with m.Pool(2) as p: print(sum(p.map(sq, range(10))))\n"
    )
    sbx.files.write("/tmp/mp_e2b.py", code)
    assert sbx.commands.run("python /tmp/mp_e2b.py", timeout=120).stdout == "285\n"


# ------------------------------------------ fork, snapshots, list, connect (issue 13)


def _e2b_post(path, body):
    import httpx

    return httpx.post(os.environ["E2B_API_URL"] + path, json=body,
                      headers={"X-API-KEY": os.environ["E2B_API_KEY"]}, timeout=120)


def test_fork_count_copies_files_env_and_metadata():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "fork-src"}, envs={"FORK_ENV": "inherited"}, timeout=600)
    forks = []
    try:
        s.files.write("/tmp/fork_state.txt", "before fork")
        forks = s.fork(count=2, timeout=300)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 2 and s.sandbox_id not in ids
        for f in forks:
            assert f.files.read("/tmp/fork_state.txt") == "before fork"
            assert f.commands.run("echo $FORK_ENV").stdout == "inherited\n"
            assert f.get_info().metadata.get("role") == "fork-src"
        forks[0].files.write("/tmp/fork_state.txt", "changed in fork")
        assert s.files.read("/tmp/fork_state.txt") == "before fork"
        assert s.is_running()
        # A strata fork: strata's own API shows it, made from a snapshot of the source.
        r = _strata("GET", f"/v1/sandboxes/{forks[0].sandbox_id}")
        assert r.status_code == 200 and r.json().get("source_snapshot"), r.text
        # Bad counts are refused before anything is made.
        for bad in (0, 17):
            r = _e2b_post(f"/sandboxes/{s.sandbox_id}/fork", {"count": bad})
            assert r.status_code == 400, r.text
    finally:
        for f in forks:
            f.kill()
        s.kill()
    with pytest.raises(NotFoundException):
        Sandbox.fork(s.sandbox_id)


def test_snapshot_named_listed_created_from_and_deleted(sbx):
    name = f"e2b-snap-{time.time_ns()}"
    sbx.files.write("/tmp/snap_state.txt", "in snapshot")
    snap = sbx.create_snapshot(name=name)
    try:
        assert name in snap.names
        # A strata snapshot, its name the label.
        r = _strata("GET", f"/v1/snapshots/{snap.snapshot_id}")
        assert r.status_code == 200 and r.json()["label"] == name, r.text
        assert [x.snapshot_id for x in Sandbox.list_snapshots(name=name).next_items()] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name=name + "-none").next_items() == []
        # Pages of one: every snapshot of the sandbox once, ours among them.
        pages = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
        seen = []
        while pages.has_next:
            items = pages.next_items()
            assert len(items) <= 1
            seen += [x.snapshot_id for x in items]
        assert snap.snapshot_id in seen and len(seen) == len(set(seen))
        sbx.files.write("/tmp/snap_state.txt", "after snapshot")
        for ref in (snap.snapshot_id, name):
            n = Sandbox.create(ref, timeout=300)
            try:
                assert n.files.read("/tmp/snap_state.txt") == "in snapshot"
            finally:
                n.kill()
    finally:
        deleted = Sandbox.delete_snapshot(snap.snapshot_id)
    assert deleted is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_list_order_started_after_template_and_pages():
    from e2b import SandboxQuery

    tag = f"order-{time.time_ns()}"
    a = Sandbox.create(metadata={"suite": SUITE, "role": tag}, timeout=300)
    b = Sandbox.create(metadata={"suite": SUITE, "role": tag}, timeout=300)
    try:
        q = SandboxQuery(metadata={"role": tag})

        def ids(**kw):
            return [x.sandbox_id for x in Sandbox.list(**kw).next_items()]

        assert ids(query=q) == [b.sandbox_id, a.sandbox_id]  # newest first
        assert ids(query=q, order="asc") == [a.sandbox_id, b.sandbox_id]
        p = Sandbox.list(query=q, limit=1)
        assert [x.sandbox_id for x in p.next_items()] == [b.sandbox_id] and p.has_next
        assert [x.sandbox_id for x in p.next_items()] == [a.sandbox_id] and not p.has_next
        ib = b.get_info()
        assert ids(query=SandboxQuery(metadata={"role": tag}, started_after=ib.started_at)) == [b.sandbox_id]
        assert ids(query=SandboxQuery(metadata={"role": tag}, template=ib.template_id)) == [b.sandbox_id, a.sandbox_id]
        assert ids(query=SandboxQuery(metadata={"role": tag}, template="tpl-none")) == []
    finally:
        a.kill()
        b.kill()


def test_connect_does_not_shorten_a_running_timeout(sbx):
    before = sbx.get_info().end_at
    Sandbox.connect(sbx.sandbox_id, timeout=10)
    assert sbx.get_info().end_at >= before
    assert sbx.is_running()
