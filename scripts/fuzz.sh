#!/usr/bin/env bash
# Fuzzes what faces the outside (docs/fuzzing.md): builds every libFuzzer
# target of fuzz/ and runs each for N seconds (default 60), failing on a
# crash, a panic, a timeout or an out-of-memory.
#   scripts/fuzz.sh            # 60 s per target
#   scripts/fuzz.sh 10         # 10 s per target
#   scripts/fuzz.sh 60 frame_decode   # only the named targets
# Uses the installed stable toolchain (RUSTC_BOOTSTRAP=1 for -Zsanitizer);
# installs cargo-fuzz (a cargo subcommand) into ~/.cargo/bin if missing.
# Crash inputs land in fuzz/artifacts/<target>/ (reproduce with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> <file>` from the repo root).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

seconds="${1:-${STRATA_FUZZ_SECONDS:-60}}"
shift || true
case "$seconds" in '' | *[!0-9]*) echo "fuzz: seconds must be a number, got '$seconds'" >&2; exit 2 ;; esac

CARGO_FUZZ_VERSION=0.13.2
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION into ~/.cargo/bin" >&2
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi
command -v c++ >/dev/null || { echo "fuzz: libfuzzer-sys needs a C++ compiler (apt-get install g++)" >&2; exit 1; }

# The stable toolchain, with the unstable flags cargo-fuzz passes (-Zsanitizer, …).
export RUSTC_BOOTSTRAP=1
# Outside the work tree, so a fresh clone (CI) reuses the instrumented
# dependency build of the last run on this machine.
target_dir="${STRATA_FUZZ_TARGET_DIR:-$HOME/.cache/strata-fuzz/target}"
fz=(--fuzz-dir fuzz --target-dir "$target_dir")

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi

start=$(date +%s)
echo "fuzz: building ${targets[*]}" >&2
if [ "$#" -gt 0 ]; then
  for t in "${targets[@]}"; do cargo fuzz build "${fz[@]}" "$t"; done
else
  cargo fuzz build "${fz[@]}" # one cargo run for all targets
fi
built=$(date +%s)

# libFuzzer adds what it finds to the first corpus directory: a scratch copy,
# so the committed seeds (fuzz/corpus/<target>) stay small.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t" "fuzz/artifacts/$t"
  echo "fuzz: $t for ${seconds}s" >&2
  if ! cargo fuzz run "${fz[@]}" "$t" "$scratch/$t" "fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="fuzz/artifacts/$t/"; then
    failed+=("$t")
  fi
done
end=$(date +%s)
echo "fuzz: build $((built - start))s, runs $((end - built))s" >&2
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, no crash" >&2
