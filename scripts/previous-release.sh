#!/usr/bin/env bash
# Builds (once) the previous release's guest agent for the compatibility test
# (crates/strata-runtime/tests/compat.rs) and prints the binary's path.
#
#   scripts/previous-release.sh            # commit from tests/compat/PREVIOUS_RELEASE
#   scripts/previous-release.sh <commit>   # another one
#
# Cached under ${STRATA_COMPAT_CACHE:-/var/cache/strata/compat}/<commit>/strata-agent:
# a cached binary is reused, so a warm run takes well under a second. A cold run
# checks the commit out with `git worktree add --detach` into the cache, builds
# `cargo build --release -p strata-agent` there with its own CARGO_TARGET_DIR
# (the cache's target/, shared by every commit so the next bump rebuilds only
# what changed; the workspace's target dir and its lock are not touched),
# copies the binary out and removes the worktree.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PATH="$HOME/.cargo/bin:$PATH"

pin="$root/crates/strata-runtime/tests/compat/PREVIOUS_RELEASE"
want="${1:-$(sed -e 's/#.*//' "$pin" | tr -d '[:space:]')}"
if [ -z "$want" ]; then
    echo "previous-release: no commit in $pin" >&2
    exit 1
fi
if ! commit="$(git -C "$root" rev-parse --verify --quiet "$want^{commit}")"; then
    cat >&2 <<EOF
previous-release: commit $want (the previous release, from $pin)
is not in this clone's history. The compatibility test needs it:
  - a shallow clone: git -C $root fetch --unshallow   (or clone without --depth)
  - a clone without that branch: git -C $root fetch origin $want
  - or set another commit in $pin (the release before the current work).
EOF
    exit 1
fi

cache_root="${STRATA_COMPAT_CACHE:-/var/cache/strata/compat}"
cache="$cache_root/$commit"
bin="$cache/strata-agent"
if [ -x "$bin" ]; then
    echo "previous-release: cached $bin" >&2
    echo "$bin"
    exit 0
fi

mkdir -p "$cache"
exec 9>"$cache_root/.lock"
flock 9
if [ -x "$bin" ]; then # built by another run while this one waited
    echo "$bin"
    exit 0
fi

src="$cache/src"
cleanup() {
    git -C "$root" worktree remove --force "$src" >/dev/null 2>&1 || rm -rf "$src"
    git -C "$root" worktree prune >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup
echo "previous-release: building strata-agent of ${commit:0:12} in $src" >&2
start=$(date +%s)
git -C "$root" worktree add --detach --quiet "$src" "$commit"
(cd "$src" && CARGO_TARGET_DIR="$cache_root/target" cargo build --release --locked -p strata-agent)
cp "$cache_root/target/release/strata-agent" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$commit" >"$cache/COMMIT"
echo "previous-release: built $bin in $(($(date +%s) - start)) s" >&2
echo "$bin"
