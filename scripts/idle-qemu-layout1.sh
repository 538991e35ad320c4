#!/bin/bash
# For crates/strata-bench/examples/idle_probe.rs: QEMU with the layout-1 command
# line (drops the layout-2 `-cpu qemu64,+arat`), to measure "before" beside "after".
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "-cpu" ] && [ "$2" = "qemu64,+arat" ]; then shift 2; continue; fi
  args+=("$1"); shift
done
exec /usr/bin/qemu-system-x86_64 "${args[@]}"
