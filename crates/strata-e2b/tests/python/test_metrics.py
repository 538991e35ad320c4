"""Sandbox metrics through the unmodified e2b SDK: `Sandbox.get_metrics()`
(instance and class form) and the list form `GET /sandboxes/metrics`,
answered from the daemon's per-sandbox sampler (every 5 s by default, so
the first sample of a new sandbox takes up to two intervals)."""

import datetime
import os
import time

import httpx
import pytest
from e2b import Sandbox, SandboxMetrics
from e2b.exceptions import NotFoundException

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]


def _wait_metrics(get, within=40.0):
    t = time.time()
    while True:
        got = get()
        if got or time.time() - t > within:
            return got
        time.sleep(1)


def test_get_metrics_returns_sane_samples(sbx):
    metrics = _wait_metrics(sbx.get_metrics)
    assert metrics, "no metrics within 40 s"
    for m in metrics:
        assert isinstance(m, SandboxMetrics)
        assert m.cpu_count >= 1
        assert 0.0 <= m.cpu_used_pct <= 100.0
        assert 0 < m.mem_used <= m.mem_total
        assert m.mem_total >= 64 << 20
        assert 0 < m.disk_used <= m.disk_total
        assert isinstance(m.timestamp, datetime.datetime)
    stamps = [m.timestamp for m in metrics]
    assert stamps == sorted(stamps)
    # The class form, and a range that ends before the sandbox existed.
    again = Sandbox.get_metrics(sbx.sandbox_id)
    assert len(again) >= len(metrics)
    early = datetime.datetime(2001, 1, 1, tzinfo=datetime.timezone.utc)
    assert sbx.get_metrics(end=early) == []
    newest = metrics[-1].timestamp
    later = sbx.get_metrics(start=newest)
    assert later and all(m.timestamp >= newest.replace(microsecond=0) for m in later)


def test_list_form_and_unknown_sandboxes(sbx):
    _wait_metrics(sbx.get_metrics)
    unknown = "sb-00000000000000000000000000"
    r = httpx.get(
        f"{API}/sandboxes/metrics",
        params={"sandbox_ids": f"{sbx.sandbox_id},{unknown}"},
        headers={"X-API-KEY": KEY},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    got = r.json()["sandboxes"]
    assert list(got) == [sbx.sandbox_id], got
    m = got[sbx.sandbox_id]
    for k in ("timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed",
              "memTotal", "memCache", "diskUsed", "diskTotal"):
        assert k in m, (k, m)
    r = httpx.get(f"{API}/sandboxes/metrics", headers={"X-API-KEY": KEY}, timeout=30)
    assert r.status_code == 400, r.text
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(unknown)


def test_another_tenants_sandbox_is_not_found(sbx):
    other = os.environ.get("E2B_TENANT_KEY")
    if not other:
        pytest.skip("run-python.sh sets E2B_TENANT_KEY")
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(sbx.sandbox_id, api_key=other)
    r = httpx.get(
        f"{API}/sandboxes/metrics",
        params={"sandbox_ids": sbx.sandbox_id},
        headers={"X-API-KEY": other},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["sandboxes"] == {}, r.text
