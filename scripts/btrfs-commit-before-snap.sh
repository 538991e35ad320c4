#!/bin/bash
# Measurement script for docs/bench/soak.md ("Committing before the pause").
# Does committing the btrfs transaction (BTRFS_IOC_START_SYNC + WAIT_SYNC) after the RAM file's
# fdatasync and before the snapshot take the commit's work out of the snapshot?
# Alternates A (fdatasync only) and B (fdatasync + START_SYNC/WAIT_SYNC) per snapshot:
# usage: scripts/btrfs-commit-before-snap.sh [SNAPSHOTS=200] [PAGES_PER_SNAPSHOT=1024] (root).
set -euo pipefail
N=${1:-200}; PAGES=${2:-1024}
d=$(mktemp -d /tmp/precommit.XXXX)
truncate -s 16G $d/img; mkfs.btrfs -q $d/img
mkdir $d/m; mount -o loop,noatime,user_subvol_rm_allowed,discard=async $d/img $d/m
trap 'umount $d/m; rm -rf $d' EXIT
btrfs -q subvolume create $d/m/src; mkdir -p $d/m/snaps
dd if=/dev/urandom of=$d/m/src/mem bs=1M count=256 status=none; sync
python3 - "$d/m" "$N" "$PAGES" <<'PY'
import os, subprocess, sys, time, random, fcntl
root, n, pages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
f = os.open(f"{root}/src/mem", os.O_WRONLY)
rootfd = os.open(root, os.O_RDONLY)
buf = os.urandom(4096)
res = {"A": [], "B": []}; pre = {"A": [], "B": []}
for i in range(n):
    arm = "AB"[i % 2]
    for _ in range(pages):
        os.pwrite(f, buf, random.randrange(65536) * 4096)
    t = time.perf_counter()
    os.fdatasync(f)
    if arm == "B":
        import struct; tid = bytearray(8); fcntl.ioctl(rootfd, 0x80089418, tid, True); fcntl.ioctl(rootfd, 0x40089416, bytes(tid))
    pre[arm].append((time.perf_counter() - t) * 1000)
    dst = f"{root}/snaps/{i}"
    t = time.perf_counter()
    subprocess.run(["btrfs", "-q", "subvolume", "snapshot", f"{root}/src", dst], check=True)
    res[arm].append((time.perf_counter() - t) * 1000)
    subprocess.run(["btrfs", "-q", "property", "set", dst, "ro", "true"], check=True)
    if (i + 1) % 50 == 0:
        for a in "AB":
            b = sorted(res[a][-25:]); p = sorted(pre[a][-25:])
            print(f"{i+1:>5} {a}: snapshot p50 {b[12]:.1f} max {b[-1]:.1f} ms | before-pause work p50 {p[12]:.1f} ms", flush=True)
PY
