"""Lifecycle with the unmodified SDK on real guests: `Sandbox.create(
lifecycle=...)` (`on_timeout` pause or kill, `auto_resume`), as `get_info()`
reports it, and what the timeout and a paused sandbox's envd calls do; and
`allow_internet_access=False` / `update_network()` as the sandbox's egress
policy decides them (the proxy's own path to an upstream is
tests/network.rs's, offline)."""

import os
import time

import httpx
import pytest
from e2b import NotFoundException, Sandbox, SandboxException, SandboxState

SUITE = os.environ.get("STRATA_E2B_SUITE", "strata-e2b-tests")


def wait_until(what, within_s=120):
    end = time.time() + within_s
    while True:
        got = what()
        if got:
            return got
        assert time.time() < end, f"not within {within_s}s"
        time.sleep(1)


def gone(sandbox_id):
    try:
        Sandbox.get_info(sandbox_id)
        return False
    except NotFoundException:
        return True


def state(sandbox_id):
    return Sandbox.get_info(sandbox_id).state.value


def test_kill_on_timeout_deletes_the_sandbox():
    s = Sandbox.create(
        metadata={"suite": SUITE, "role": "lc-kill"},
        timeout=5,
        lifecycle={"on_timeout": "kill"},
    )
    try:
        info = s.get_info()
        assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
        assert s.commands.run("echo up").stdout == "up\n"
        wait_until(lambda: gone(s.sandbox_id))
        assert Sandbox.kill(s.sandbox_id) is False
    finally:
        s.kill()


def test_pause_on_timeout_then_any_envd_call_wakes_it():
    s = Sandbox.create(
        metadata={"suite": SUITE, "role": "lc-pause"},
        timeout=5,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
    )
    try:
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        s.files.write("/tmp/kept.txt", "kept")
        wait_until(lambda: state(s.sandbox_id) == "paused")
        # auto_resume: the command wakes it, the file is still there.
        assert s.commands.run("cat /tmp/kept.txt").stdout == "kept"
        assert state(s.sandbox_id) == "running"
    finally:
        s.kill()


def test_auto_resume_false_stays_paused_until_connect():
    s = Sandbox.create(
        metadata={"suite": SUITE, "role": "lc-noresume"},
        timeout=600,
        lifecycle={"on_timeout": "pause", "auto_resume": False},
    )
    try:
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        s.files.write("/tmp/kept.txt", "kept")
        assert s.pause() is True
        with pytest.raises(SandboxException) as e:
            s.commands.run("true")
        assert "not found" in str(e.value) or "not running" in str(e.value), e.value
        assert state(s.sandbox_id) == "paused"
        s2 = Sandbox.connect(s.sandbox_id)
        assert state(s.sandbox_id) == "running"
        assert s2.files.read("/tmp/kept.txt") == "kept"
    finally:
        s.kill()


def egress_effect(sandbox_id, host):
    """The policy's verdict on sandbox `sandbox_id`'s guest opening a tunnel
    to `host` (strata's own API, as the bootstrap admin)."""
    r = httpx.post(
        os.environ["E2B_API_URL"] + "/v1/policy/test",
        headers={"Authorization": f"Bearer {os.environ['STRATA_TOKEN']}"},
        json={
            "sandbox": sandbox_id,
            "call": {"kind": "egress", "host": host, "port": 443, "method": "CONNECT", "path": "/", "scheme": "https"},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["effect"]


def test_allow_internet_access_false_and_update_network():
    s = Sandbox.create(metadata={"suite": SUITE, "role": "net"}, timeout=600, allow_internet_access=False)
    try:
        assert egress_effect(s.sandbox_id, "example.com") == "deny"
        # Deny everything but one domain: the allowed one wins.
        s.update_network({"allow_out": ["example.com"], "deny_out": ["0.0.0.0/0"]})
        assert egress_effect(s.sandbox_id, "example.com") == "allow"
        assert egress_effect(s.sandbox_id, "other.example") == "deny"
        # Omitted fields are cleared: back to the tenant's policy.
        s.update_network({})
        assert egress_effect(s.sandbox_id, "other.example") == "allow"
        # A domain in denyOut is refused (E2B takes IPs and CIDRs there) and
        # changes nothing.
        with pytest.raises(SandboxException):
            s.update_network({"deny_out": ["example.com"]})
        assert egress_effect(s.sandbox_id, "other.example") == "allow"
    finally:
        s.kill()


def test_timeout_pause_without_memory_cold_boots_on_connect():
    # on_timeout pause with keep_memory False: the timeout's pause keeps the
    # disk only; traffic does not wake it; connect cold-boots it.
    s = Sandbox.create(
        metadata={"suite": SUITE, "role": "fs-only-timeout"},
        timeout=3,
        lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}},
    )
    try:
        s.files.write("/home/user/fs-only.txt", "kept")
        boot = s.files.read("/proc/sys/kernel/random/boot_id").strip()
        deadline = time.time() + 60
        while s.get_info().state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused by its timeout"
            time.sleep(1)
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        resumed = s.connect()
        assert resumed.files.read("/home/user/fs-only.txt").strip() == "kept"
        assert resumed.files.read("/proc/sys/kernel/random/boot_id").strip() != boot
    finally:
        s.kill()

