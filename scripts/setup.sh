#!/usr/bin/env bash
# Installs everything strata needs on a Debian 12 host (idempotent), as root.
set -euo pipefail

# Installed with --no-install-recommends (QEMU recommends GTK and GStreamer):
# everything strata calls is named here. QEMU: qemu-system-x86 (microvm's
# firmware, seabios, is a dependency), qemu-utils and qemu-block-extra below.
# Image builds: debootstrap (+ debian-archive-keyring to check the mirror's
# signatures: only a recommendation of debootstrap), busybox-static, kmod
# (depmod), e2fsprogs (mkfs.ext4), xz-utils, zstd, cpio. Pools: btrfs-progs,
# mount (losetup, mount) and util-linux. Building: gcc with libc6-dev (only a
# recommendation of gcc; cargo links with cc), pkg-config; g++ for libFuzzer
# (scripts/fuzz.sh: libfuzzer-sys compiles it). Scripts and the
# E2B SDK tests: curl, ca-certificates, python3, python3-venv, iproute2,
# nodejs and npm (below).
# libnss-myhostname: glibc resolves *.localhost to loopback (the E2B door's
# get_host(port) names, docs/ports.md), for Python and Node as curl does.
# postgresql-15: the PostgreSQL store's tests (scripts/test-pg.sh starts a
# throwaway cluster of its own; Debian's `main` cluster is not used).
# chromium: the web console's end-to-end tests (scripts/run-console.sh drive
# Debian's browser with playwright-core; no browser is downloaded).
need_pkgs=(qemu-system-x86 btrfs-progs debootstrap debian-archive-keyring busybox-static e2fsprogs
           cpio zstd kmod xz-utils mount util-linux iproute2 ca-certificates curl python3
           python3-venv gcc g++ libc6-dev pkg-config libnss-myhostname chromium postgresql-15)
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The e2b JS SDK tests (crates/strata-e2b/tests/js): node and npm, checked as
# commands (a Node from elsewhere, e.g. NodeSource's nodejs with its own npm,
# is kept). run-js.sh adds a newer Node from npm when this one is too old.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
# kubectl, for `kubectl kustomize` in scripts/k8s-validate.sh (offline; no
# cluster): checked as a command, so another kubectl is kept; without one,
# Debian's kubernetes-client (kubectl 1.20, kustomize v2.0.3: the manifests
# stay within what it renders).
command -v kubectl >/dev/null || missing+=(kubernetes-client)
# qemu-img must match QEMU 7.2 from bookworm (a backported qemu-utils conflicts with qemu-system-x86 7.2).
qemu_utils_ok=0
if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q '^1:7\.2'; then qemu_utils_ok=1; fi
if [ "${#missing[@]}" -gt 0 ] || [ "$qemu_utils_ok" = 0 ]; then
  echo "setup: installing ${missing[*]} qemu-utils(7.2)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends --allow-downgrades "${missing[@]}" \
    qemu-utils/bookworm qemu-block-extra/bookworm
fi

# `myhostname` on the hosts line (after `files`): <port>-<id>.localhost
# resolves to 127.0.0.1. Revert: remove the word from /etc/nsswitch.conf.
if ! grep -Eq '^hosts:.*\bmyhostname\b' /etc/nsswitch.conf 2>/dev/null; then
  echo "setup: adding myhostname to the hosts line of /etc/nsswitch.conf" >&2
  if grep -Eq '^hosts:.*\bfiles\b' /etc/nsswitch.conf; then
    sed -i -E '/^hosts:/ s/\bfiles\b/files myhostname/' /etc/nsswitch.conf
  else
    sed -i -E '/^hosts:/ s/$/ myhostname/' /etc/nsswitch.conf
  fi
fi

modprobe loop 2>/dev/null || true
modprobe btrfs 2>/dev/null || true
grep -qw btrfs /proc/filesystems || { echo "setup: this kernel has no btrfs support" >&2; exit 1; }

# QEMU drops to this system user after opening its files (`-runas`, see docs/hardening.md).
# /dev/kvm is opened before the drop; the kvm group lets the user reopen it if QEMU ever needs to.
if ! getent passwd strata-vm >/dev/null; then
  echo "setup: creating system user strata-vm" >&2
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin strata-vm
fi
if getent group kvm >/dev/null && ! id -nG strata-vm | tr ' ' '\n' | grep -qx kvm; then
  usermod -a -G kvm strata-vm
fi

if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; else
    echo "setup: cargo not found: install Rust (rustup) first" >&2; exit 1; fi
fi
echo "setup: ok ($(qemu-system-x86_64 --version | head -1); $(btrfs --version))" >&2
