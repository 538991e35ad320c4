"""The e2b SDK side of strata-bench's `sdk` section: `Sandbox.create()` +
first `commands.run("true")`, and `sandbox.fork(count=N)`, through the
unmodified SDK against the daemon E2B_API_URL names. strata's own /v1 side
of the same operations is measured by strata-bench itself, on the same
daemon, and printed beside these (`strata-bench --only sdk`).

    python bench.py N [--forks 4] [--warmup 1] [--json]

`--json` prints the samples (milliseconds) as one JSON object on stdout;
otherwise p50/p95/p99 lines (run-python.sh's BENCH=N). Every sandbox made is
killed; a fork that fails, or a command that does not exit 0, fails the run.
"""

import argparse
import json
import math
import sys
import time

from e2b import Sandbox

META = {"suite": "strata-e2b-bench"}


def ms(t0, t1):
    return (t1 - t0) * 1000.0


def create_and_run():
    t0 = time.perf_counter()
    s = Sandbox.create(metadata=META, timeout=600)
    try:
        t1 = time.perf_counter()
        r = s.commands.run("true")
        t2 = time.perf_counter()
        if r.exit_code != 0:
            sys.exit(f"commands.run('true') exited {r.exit_code}")
    finally:
        s.kill()
    return ms(t0, t1), ms(t1, t2)


def fork(parent, count):
    t0 = time.perf_counter()
    forks = parent.fork(count=count, timeout=600)
    t1 = time.perf_counter()
    bad = [f for f in forks if not isinstance(f, Sandbox)]
    for f in forks:
        if isinstance(f, Sandbox):
            f.kill()
    if bad or len(forks) != count:
        sys.exit(f"fork(count={count}) gave {len(forks)} results, failed: {bad}")
    return ms(t0, t1)


def pct(v, p):
    """Nearest rank, as strata-bench's stats.rs."""
    v = sorted(v)
    return v[min(len(v), max(1, math.ceil(p / 100 * len(v)))) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=10)
    ap.add_argument("--forks", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    create, first, total = [], [], []
    for i in range(a.warmup + a.n):
        c, f = create_and_run()
        if i >= a.warmup:
            create.append(c)
            first.append(f)
            total.append(c + f)

    forked = []
    parent = Sandbox.create(metadata=META, timeout=600)
    try:
        for i in range(a.warmup + a.n):
            d = fork(parent, a.forks)
            if i >= a.warmup:
                forked.append(d)
    finally:
        parent.kill()

    if a.json:
        print(json.dumps({"create_ms": create, "first_run_ms": first, "create_run_ms": total,
                          "fork_ms": forked, "forks": a.forks}))
        return
    for name, v in [("create", create), ("first run", first), ("create+run", total),
                    (f"fork(count={a.forks})", forked)]:
        print(f"e2b SDK {name:>14}: n={len(v)} p50={pct(v, 50):.0f} ms p95={pct(v, 95):.0f} ms "
              f"p99={pct(v, 99):.0f} ms max={max(v):.0f} ms")
    print("strata's /v1 beside it: strata-bench --only sdk", file=sys.stderr)


if __name__ == "__main__":
    main()
