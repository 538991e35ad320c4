"""`Sandbox.create()` + first `commands.run("true")` through the e2b SDK,
p50/p99, next to the same through strata's own HTTP API (create, exec
`true`, delete: the calls `strata create` / `strata exec` make)."""

import os
import sys
import time

import httpx
from e2b import Sandbox

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
create_ms, first_ms, total_ms = [], [], []
for i in range(n):
    t0 = time.perf_counter()
    s = Sandbox.create(metadata={"suite": "strata-e2b-bench"})
    t1 = time.perf_counter()
    s.commands.run("true")
    t2 = time.perf_counter()
    s.kill()
    create_ms.append((t1 - t0) * 1000)
    first_ms.append((t2 - t1) * 1000)
    total_ms.append((t2 - t0) * 1000)


def pct(v, p):
    v = sorted(v)
    k = max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))
    return v[k]


base = os.environ["E2B_API_URL"]
s_create, s_first, s_total = [], [], []
with httpx.Client(base_url=base, timeout=300, headers={"Authorization": f"Bearer {os.environ.get('STRATA_TOKEN', '')}"}) as c:
    for i in range(n):
        t0 = time.perf_counter()
        r = c.post("/v1/sandboxes", json={"labels": {"suite": "strata-e2b-bench"}})
        r.raise_for_status()
        sid = r.json()["id"]
        t1 = time.perf_counter()
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
        r.raise_for_status()
        assert '"exit"' in r.text, r.text
        t2 = time.perf_counter()
        c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        s_create.append((t1 - t0) * 1000)
        s_first.append((t2 - t1) * 1000)
        s_total.append((t2 - t0) * 1000)

for label, rows in [
    ("e2b SDK", [("create", create_ms), ("first run", first_ms), ("create+run", total_ms)]),
    ("strata API", [("create", s_create), ("first exec", s_first), ("create+exec", s_total)]),
]:
    for name, v in rows:
        print(f"{label:>10} {name:>11}: n={len(v)} p50={pct(v, 50):.0f} ms p99={pct(v, 99):.0f} ms min={min(v):.0f} max={max(v):.0f}")
