#!/usr/bin/env bash
# Installs everything strata needs on a Debian 12 host (idempotent), as root.
set -euo pipefail

need_pkgs=(qemu-system-x86 btrfs-progs debootstrap busybox-static e2fsprogs cpio zstd kmod xz-utils
           util-linux iproute2 ca-certificates curl python3 python3-venv gcc pkg-config)
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# qemu-img must match QEMU 7.2 from bookworm (a backported qemu-utils conflicts with qemu-system-x86 7.2).
qemu_utils_ok=0
if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q '^1:7\.2'; then qemu_utils_ok=1; fi
if [ "${#missing[@]}" -gt 0 ] || [ "$qemu_utils_ok" = 0 ]; then
  echo "setup: installing ${missing[*]} qemu-utils(7.2)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --allow-downgrades "${missing[@]}" qemu-utils/bookworm qemu-block-extra/bookworm
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
