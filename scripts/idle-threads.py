#!/usr/bin/env python3
"""Per-thread CPU and context switches of QEMU processes over a window.

usage: idle-threads.py SECS PID [PID...]
Prints, per thread name (summed over the PIDs, then divided by their count):
% of one core, voluntary and involuntary context switches per second.
"""
import os, sys, time, collections

HZ = os.sysconf("SC_CLK_TCK")

def snap(pid):
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            stat = open(f"{base}/{tid}/stat").read()
            status = open(f"{base}/{tid}/status").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        f = stat[stat.rindex(")") + 2 :].split()
        ticks = int(f[11]) + int(f[12])
        vol = invol = 0
        for l in status.splitlines():
            if l.startswith("voluntary_ctxt_switches"):
                vol = int(l.split()[1])
            elif l.startswith("nonvoluntary_ctxt_switches"):
                invol = int(l.split()[1])
        out[tid] = (name, ticks, vol, invol)
    return out

def main():
    secs = float(sys.argv[1])
    pids = sys.argv[2:]
    a = {p: snap(p) for p in pids}
    t0 = time.time()
    time.sleep(secs)
    b = {p: snap(p) for p in pids}
    dt = time.time() - t0
    agg = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    per_pid = {}
    for p in pids:
        tot = 0
        for tid, (name, t1, v1, i1) in b[p].items():
            if tid not in a[p]:
                continue
            _, t0_, v0, i0 = a[p][tid]
            # worker threads are numbered: group them
            key = name.rstrip("0123456789") if name.startswith("worker") else name
            g = agg[key]
            g[0] += (t1 - t0_) / HZ / dt * 100
            g[1] += (v1 - v0) / dt
            g[2] += (i1 - i0) / dt
            g[3] += 1
            tot += t1 - t0_
        per_pid[p] = tot / HZ / dt * 100
    n = len(pids)
    print(f"window {dt:.1f} s, {n} processes; per process (mean):")
    print(f"{'thread':24} {'threads':>7} {'cpu %':>8} {'vol cs/s':>9} {'invol/s':>8}")
    for k, (c, v, i, cnt) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:24} {cnt/n:7.1f} {c/n:8.3f} {v/n:9.1f} {i/n:8.1f}")
    print("process total %:", " ".join(f"{p}:{v:.2f}" for p, v in per_pid.items()),
          f"mean {sum(per_pid.values())/n:.3f}")

main()
