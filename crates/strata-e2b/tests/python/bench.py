"""`Sandbox.create()` + first `commands.run("true")` through the e2b SDK, p50/p99."""

import statistics
import sys
import time

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


for name, v in [("create", create_ms), ("first run", first_ms), ("create+run", total_ms)]:
    print(f"{name:>11}: n={len(v)} p50={pct(v, 50):.0f} ms p99={pct(v, 99):.0f} ms min={min(v):.0f} max={max(v):.0f}")
