#!/usr/bin/env bash
# The alternative to size variants, measured (docs/bench/variants/balloon.md):
# one template booted at a maximum size (2 vCPUs, 2048 MiB) with a
# virtio-balloon-device, forks sized down to 512 MiB by inflating the balloon
# and to 1 vCPU by offlining cpu1 in the guest. Not a strata feature: strata's
# device layout has no balloon, so a wrapper adds one to every QEMU this
# daemon starts (and a second QMP socket to drive it), and the guest kernel's
# virtio_balloon module (not in the image) is loaded from Debian's package.
#
#   sudo docs/bench/variants/balloon-spike.sh [forks]     # default 10
#
# Needs: target/debug/stratad, the guest image (scripts/test.sh builds both),
# apt access (apt-get download linux-image-<guest kernel>). Leaves nothing
# running; prints one line per fork and a summary.
set -euo pipefail
N="${1:-10}"
ROOT="${ROOT:-$(cd "$(dirname "$0")/../../.." && pwd)}"
W="${W:-/tmp/strata-balloon-spike}"
PORT="${PORT:-48911}"
URL="http://127.0.0.1:$PORT"
rm -rf "$W"; RUN="${RUN_DIR:-/tmp/sbs-run}"; rm -rf "$RUN"; mkdir -p "$RUN" "$W/qmp"
chmod 755 "$W" "$W/qmp"

IMG="${IMAGE_DIR:-}"
if [ -z "$IMG" ]; then
  for d in /var/cache/strata/images/*/; do
    if [ -f "$d/manifest.json" ]; then IMG="$d"; break; fi
  done
fi
KVER="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["kernel_version"])' "$IMG/manifest.json")"
( cd "$W" && apt-get download "linux-image-$KVER" >/dev/null 2>&1 )
dpkg-deb --fsys-tarfile "$W"/linux-image-*.deb | tar -x -C "$W" "./lib/modules/$KVER/kernel/drivers/virtio/virtio_balloon.ko"
KO="$W/lib/modules/$KVER/kernel/drivers/virtio/virtio_balloon.ko"

cat > "$W/qemu" <<WRAP
#!/bin/sh
name=""; prev=""
for a in "\$@"; do [ "\$prev" = "-name" ] && name="\$a"; prev="\$a"; done
name="\${name#guest=}"; name="\${name%%,*}"
exec qemu-system-x86_64 "\$@" -device virtio-balloon-device,free-page-reporting=on \
  -qmp "unix:$W/qmp/\$name.sock,server=on,wait=off"
WRAP
chmod 755 "$W/qemu"
cat > "$W/stratad.toml" <<CONF
qemu_binary = "$W/qemu"
[default_size]
vcpus = 2
memory_mib = 2048
disk_gib = 2
[pools]
default_template = 0
CONF
"$ROOT/target/debug/stratad" --config "$W/stratad.toml" --listen "127.0.0.1:$PORT" --data-dir "$W/data" \
  --run-dir "$RUN" --accel tcg --pool-size-gib 16 --image-dir "$IMG" >"$W/daemon.log" 2>&1 &
DPID=$!
cleanup() {
  kill "$DPID" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.2; done
  for f in "$RUN"/*/qemu.pid; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true; done
  sleep 0.5
  mountpoint -q "$W/data/pool" && umount "$W/data/pool" || true
  for dev in $(losetup -j "$W/data/pool.img" -O NAME -n 2>/dev/null); do losetup -d "$dev"; done
}
trap cleanup EXIT
for _ in $(seq 1 120); do curl -fsS "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.5; done
export W URL N KO RUN
python3 - <<'PY'
import base64, json, os, socket, statistics, time, urllib.request

W, URL, N, KO = os.environ["W"], os.environ["URL"], int(os.environ["N"]), os.environ["KO"]
TOK = open(f"{W}/data/admin.token").read().strip()

def api(method, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    r = urllib.request.Request(URL + path, data=data, method=method,
                               headers={"Authorization": f"Bearer {TOK}", "Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as resp:
        t = resp.read()
        try:
            return json.loads(t)
        except ValueError:
            return t

def sh(sid, script):
    r = urllib.request.Request(URL + f"/v1/sandboxes/{sid}/exec",
                               data=json.dumps({"cmd": ["sh", "-c", script]}).encode(), method="POST",
                               headers={"Authorization": f"Bearer {TOK}", "Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as resp:
        out = b""
        for line in resp.read().decode().splitlines():
            if line.strip():
                m = json.loads(line)
                for k in ("stdout", "stderr"):
                    if k in m:
                        out += base64.b64decode(m[k])
        return out.decode(errors="replace")

class Qmp:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX); self.s.connect(path); self.f = self.s.makefile("rw")
        self.f.readline(); self.cmd("qmp_capabilities")
    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n"); self.f.flush()
        while True:
            m = json.loads(self.f.readline())
            if "return" in m or "error" in m:
                return m

def qemu_pid(sid):
    return int(open(f"{os.environ['RUN']}/{sid}/qemu.pid").read())

def rss_mib(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS:"):
            return int(l.split()[1]) / 1024

def mem_alloc_mib(sid):
    st = os.stat(f"{W}/data/pool/sandboxes/{sid}/mem")
    return st.st_blocks * 512 / 2**20

while api("GET", "/v1/templates/tpl-default")["status"] != "ready":
    time.sleep(1)
base = api("POST", "/v1/sandboxes", {})["id"]
api("PUT", f"/v1/sandboxes/{base}/files?path=/tmp/virtio_balloon.ko", raw=open(KO, "rb").read())
load = ("python3 -c \"import ctypes,os; d=open('/tmp/virtio_balloon.ko','rb').read(); "
        "l=ctypes.CDLL(None,use_errno=True); r=l.syscall(175,d,len(d),b''); "
        "print('loaded' if r==0 else 'errno %d' % ctypes.get_errno())\"")
print("load module:", sh(base, load).strip())
print("driver:", sh(base, "ls /sys/bus/virtio/drivers/ | tr '\\n' ' '").strip())
snap = api("POST", f"/v1/sandboxes/{base}/snapshots", {})["id"]
api("POST", f"/v1/sandboxes/{base}/pause", {})  # kept: deleting it would delete its snapshots
print(f"max-size state (2 vCPU, 2048 MiB, balloon driver loaded): snapshot {snap}")

rows = []
for i in range(N):
    t0 = time.monotonic()
    r = api("POST", f"/v1/snapshots/{snap}/fork", {})
    sid = r["id"] if "id" in r else r["sandboxes"][0]["id"]
    fork_ms = (time.monotonic() - t0) * 1000
    pid = qemu_pid(sid)
    q = Qmp(f"{W}/qmp/{sid}.sock")
    rss0, blk0 = rss_mib(pid), mem_alloc_mib(sid)
    t1 = time.monotonic()
    q.cmd("balloon", value=512 * 2**20)
    while True:
        actual = q.cmd("query-balloon")["return"]["actual"]
        if actual <= 516 * 2**20 or time.monotonic() - t1 > 120:
            break
        time.sleep(0.02)
    inflate_ms = (time.monotonic() - t1) * 1000
    t2 = time.monotonic()
    cpu = sh(sid, "echo 0 > /sys/devices/system/cpu/cpu1/online; nproc").strip()
    offline_ms = (time.monotonic() - t2) * 1000
    avail = sh(sid, "awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo").strip()
    rss1, blk1 = rss_mib(pid), mem_alloc_mib(sid)
    rows.append((fork_ms, inflate_ms, offline_ms, rss0, rss1, blk0, blk1))
    print(f"fork {i}: fork {fork_ms:.0f} ms, inflate to 512 MiB {inflate_ms:.0f} ms (actual {actual/2**20:.0f} MiB, guest MemTotal {avail} MiB), "
          f"cpu1 offline {offline_ms:.0f} ms (nproc {cpu}), QEMU RSS {rss0:.0f}->{rss1:.0f} MiB, mem file allocated {blk0:.0f}->{blk1:.0f} MiB")
    if i == N - 1:
        # A hostile guest takes it all back: the driver unloaded deflates the
        # balloon, the CPU comes back online, and 1.5 GiB is allocated.
        un = sh(sid, "python3 -c \"import ctypes; l=ctypes.CDLL(None,use_errno=True); "
                     "print('unloaded' if l.syscall(176,b'virtio_balloon',0o4000)==0 else 'errno %d' % ctypes.get_errno())\"; "
                     "echo 1 > /sys/devices/system/cpu/cpu1/online; nproc; "
                     "python3 -c \"b=bytearray(1536*2**20); [b.__setitem__(i,1) for i in range(0,len(b),4096)]; print('allocated 1536 MiB')\"").strip()
        time.sleep(1)
        actual = q.cmd("query-balloon")["return"]["actual"]
        print(f"hostile guest: {un.replace(chr(10), ' / ')}; balloon actual {actual/2**20:.0f} MiB; QEMU RSS {rss_mib(pid):.0f} MiB")
    api("DELETE", f"/v1/sandboxes/{sid}")

# The chosen way, side by side in this run: the same template's 1 vCPU /
# 512 MiB size variant (built once), then forks of it at that size.
t0 = time.monotonic()
r = api("POST", "/v1/sandboxes", {"size": {"vcpus": 1, "memory_mib": 512}, "wait": True})
print(f"variant 1x512 built + first create: {(time.monotonic() - t0):.1f} s")
api("DELETE", f"/v1/sandboxes/{r['id']}")
vrows = []
for i in range(N):
    t0 = time.monotonic()
    sid = api("POST", "/v1/sandboxes", {"size": {"vcpus": 1, "memory_mib": 512}})["id"]
    fork_ms = (time.monotonic() - t0) * 1000
    pid = qemu_pid(sid)
    cpu = sh(sid, "nproc; awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo").split()
    vrows.append((fork_ms, rss_mib(pid), mem_alloc_mib(sid)))
    print(f"variant fork {i}: create {fork_ms:.0f} ms (nproc {cpu[0]}, MemTotal {cpu[1]} MiB), QEMU RSS {vrows[-1][1]:.0f} MiB, mem file allocated {vrows[-1][2]:.0f} MiB")
    api("DELETE", f"/v1/sandboxes/{sid}")

def pct(v, p):
    v = sorted(v); return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
for name, k in (("fork (2 vCPU, 2048 MiB)", 0), ("inflate to 512 MiB", 1), ("offline cpu1", 2)):
    v = [r[k] for r in rows]
    print(f"{name}: p50 {pct(v,50):.0f} ms, max of {len(v)} {max(v):.0f} ms")
print(f"QEMU RSS after fork p50 {statistics.median(r[3] for r in rows):.0f} MiB, after inflate p50 {statistics.median(r[4] for r in rows):.0f} MiB")
print(f"mem file allocated after fork p50 {statistics.median(r[5] for r in rows):.0f} MiB, after inflate p50 {statistics.median(r[6] for r in rows):.0f} MiB")
v = [r[0] for r in vrows]
print(f"variant create (fork, 1 vCPU, 512 MiB): p50 {pct(v,50):.0f} ms, max of {len(v)} {max(v):.0f} ms; QEMU RSS p50 {statistics.median(r[1] for r in vrows):.0f} MiB, mem file allocated p50 {statistics.median(r[2] for r in vrows):.0f} MiB")
b = [r[0] + r[1] + r[2] for r in rows]
print(f"per fork to a 1 vCPU / 512 MiB guest: balloon (fork + inflate + offline) p50 {pct(b,50)/1000:.1f} s vs variant fork p50 {pct(v,50)/1000:.2f} s ({pct(b,50)/pct(v,50):.0f}x)")
PY
