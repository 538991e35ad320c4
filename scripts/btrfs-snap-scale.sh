#!/bin/bash
# Measurement script for docs/bench/soak.md ("Why the pause grows").
# Does creating a btrfs snapshot get slower as snapshots accumulate? An idle,
# dedicated loop-mounted btrfs (mounted as strata mounts its pool), one
# subvolume holding a 256 MiB file that gets 4 MiB rewritten before every
# snapshot; N read-write snapshots into one directory (as strata's pool keeps
# them), then made read-only (as strata does after signing). Prints
# p50/p99 of `btrfs subvolume snapshot` per block of 250.
set -euo pipefail
N=${1:-2000}; LAYOUT=${2:-flat}
d=$(mktemp -d /tmp/snapscale.XXXX)
truncate -s 16G $d/img; mkfs.btrfs -q $d/img
mkdir $d/m; mount -o loop,noatime,user_subvol_rm_allowed,discard=async $d/img $d/m
trap 'umount $d/m; rm -rf $d' EXIT
btrfs -q subvolume create $d/m/src; mkdir -p $d/m/snaps
dd if=/dev/urandom of=$d/m/src/mem bs=1M count=256 status=none; sync
python3 - "$d/m" "$N" "$LAYOUT" <<'PY'
import os, subprocess, sys, time
root, n, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
f = os.open(f"{root}/src/mem", os.O_WRONLY)
buf = os.urandom(4 << 20)
times = []
for i in range(n):
    if layout == "pages":
        import random
        for _ in range(1024):
            os.pwrite(f, buf[:4096], random.randrange(65536) * 4096)
    else:
        os.pwrite(f, buf, (i * (4 << 20)) % (256 << 20))
    os.fdatasync(f)
    dst = f"{root}/snaps/{i}" if layout != "nested" else f"{root}/snaps/{i % 50}/{i}"
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    t = time.perf_counter()
    subprocess.run(["btrfs", "-q", "subvolume", "snapshot", f"{root}/src", dst], check=True)
    times.append((time.perf_counter() - t) * 1000)
    subprocess.run(["btrfs", "-q", "property", "set", dst, "ro", "true"], check=True)
    if (i + 1) % 250 == 0:
        b = sorted(times[-250:])
        print(f"{i+1:>5} snapshots: snapshot p50 {b[125]:.1f} ms p99 {b[247]:.1f} ms", flush=True)
PY
