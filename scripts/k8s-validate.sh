#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests (deploy/kubernetes,
# docs/kubernetes.md). For every kustomization (the base and each overlay):
#   1. render it with `kubectl kustomize` (no cluster is contacted);
#   2. validate every object strictly (unknown fields are errors) against the
#      Kubernetes JSON schemas bundled in the PyPI package kubernetes-validate
#      (pinned; installed once into a venv under /var/cache/strata/venv), for
#      the oldest and the newest Kubernetes minor it ships that we claim;
#   3. check what matters to strata (scripts/k8s-check.py): mounts against
#      stratad.toml, probes, PDB and Service selectors, pinned images, the
#      store URL from a Secret, no RBAC grants.
# Then it proves both checkers can fail: deliberately broken copies of the
# base's rendering must be rejected, each for the expected reason.
# Needs kubectl (scripts/setup.sh installs Debian's kubernetes-client when
# no kubectl is present) and python3-venv. Exit 0: everything passed.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${STRATA_K8S_VALIDATE_VERSION:-1.37.0}"
VENV="${STRATA_K8S_VALIDATE_VENV:-/var/cache/strata/venv/kubernetes-validate-$VERSION}"
# Kubernetes versions validated against (schemas bundled in the package).
K8S_VERSIONS="${STRATA_K8S_VERSIONS:-1.25.0 1.37.0}"

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('kubernetes-validate') != '$VERSION')" 2>/dev/null; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q "kubernetes-validate==$VERSION" >&2
fi
PY="$VENV/bin/python"
VALIDATE="$VENV/bin/kubernetes-validate"
command -v kubectl >/dev/null || { echo "k8s-validate: kubectl not found (scripts/setup.sh installs it)" >&2; exit 1; }

tmp=$(mktemp -d /tmp/k8s-validate.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

schema_ok() { # FILE: strict schema validation against every version
  local v
  for v in $K8S_VERSIONS; do
    "$VALIDATE" --strict --quiet --no-warn -k "$v" "$1" || return 1
  done
}

fail=0
n=0
while IFS= read -r k; do
  dir=$(dirname "$k")
  name=${dir#deploy/kubernetes/}
  out="$tmp/${name//\//_}.yaml"
  if ! kubectl kustomize "$dir" >"$out" 2>"$tmp/err"; then
    echo "k8s-validate: $dir does not render:" >&2; cat "$tmp/err" >&2; fail=1; continue
  fi
  objs=$(grep -c '^kind:' "$out" || true)
  if ! schema_ok "$out"; then
    echo "k8s-validate: $dir: schema validation failed" >&2; fail=1
  fi
  if ! "$PY" scripts/k8s-check.py "$out" >&2; then
    echo "k8s-validate: $dir: strata checks failed" >&2; fail=1
  fi
  echo "k8s-validate: $dir: $objs objects rendered, schema-valid (strict; k8s $K8S_VERSIONS), strata checks passed" >&2
  n=$((n + 1))
done < <(find deploy/kubernetes -name kustomization.yaml | sort)
[ "$n" -ge 2 ] || { echo "k8s-validate: found $n kustomizations (want the base and an overlay)" >&2; fail=1; }
[ "$fail" = 0 ] || exit 1

# Self-check: broken copies of the base must be rejected, for the reason
# planted. A checker that accepts these proves nothing about the real files.
base="$tmp/base.yaml"
grep -q 'readinessProbe:' "$base" && grep -q 'replicas: 2' "$base" || { echo "k8s-validate: self-check: the base lost what the mutations edit" >&2; exit 1; }
must_fail_schema() { # LABEL SED-EXPR
  sed "$2" "$base" >"$tmp/bad.yaml"
  if cmp -s "$base" "$tmp/bad.yaml"; then echo "k8s-validate: self-check $1: the edit changed nothing" >&2; exit 1; fi
  if schema_ok "$tmp/bad.yaml" >"$tmp/out" 2>&1; then
    echo "k8s-validate: self-check FAILED: $1 was accepted by the schema validation" >&2; exit 1
  fi
  echo "k8s-validate: self-check: $1 rejected by the schema validation: $(grep -m1 -o 'did not validate.*' "$tmp/out")" >&2
}
must_fail_check() { # LABEL EXPECTED-MESSAGE PYTHON-MUTATION (on `objs`)
  "$PY" - "$base" "$tmp/bad.yaml" "$3" <<'EOF'
import sys, yaml
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
exec(sys.argv[3])
yaml.safe_dump_all(objs, open(sys.argv[2], "w"), sort_keys=False)
EOF
  if "$PY" scripts/k8s-check.py "$tmp/bad.yaml" >"$tmp/out" 2>&1; then
    echo "k8s-validate: self-check FAILED: $1 passed the strata checks" >&2; exit 1
  fi
  if ! grep -qF "$2" "$tmp/out"; then
    echo "k8s-validate: self-check FAILED: $1 was rejected, but not for '$2':" >&2; cat "$tmp/out" >&2; exit 1
  fi
  echo "k8s-validate: self-check: $1 rejected by the strata checks: $(grep -m1 -F "$2" "$tmp/out" | sed 's/^k8s-check: [^ ]*: //')" >&2
}
must_fail_schema "a misspelled field (readinesProbe)" 's/readinessProbe:/readinesProbe:/'
must_fail_schema "a wrong type (replicas: \"two\")" 's/replicas: 2/replicas: "two"/'
must_fail_schema "an unknown kind of volume (emptyDirectory)" 's/emptyDir: {}/emptyDirectory: {}/'
ds='next(o for o in objs if o["kind"] == "DaemonSet")'
c="$ds[\"spec\"][\"template\"][\"spec\"][\"containers\"][0]"
must_fail_check "no /dev/kvm mount" "/dev/kvm is not mounted" \
  "$c['volumeMounts'] = [m for m in $c['volumeMounts'] if m['mountPath'] != '/dev/kvm']"
must_fail_check "the pool hostPath gone" "pool_path /var/lib/strata-pool is not the node's btrfs volume" \
  "$c['volumeMounts'] = [m for m in $c['volumeMounts'] if m['mountPath'] != '/var/lib/strata-pool']"
must_fail_check "the key store on an emptyDir" "key_dir /var/lib/strata-keys is not on a hostPath" \
  "v = next(v for v in $ds['spec']['template']['spec']['volumes'] if v['name'] == 'keys'); v.pop('hostPath'); v['emptyDir'] = {}"
must_fail_check "an image tagged latest" "is not pinned" \
  "$c['image'] = $c['image'].rsplit(':', 1)[0] + ':latest'"
must_fail_check "no liveness probe" "no livenessProbe" "del $c['livenessProbe']"
must_fail_check "liveness on the store check" "livenessProbe on /healthz" \
  "$c['livenessProbe']['httpGet']['path'] = '/healthz'"
must_fail_check "a PDB selecting the API pods" "not exactly the host DaemonSet's pods" \
  "p = next(o for o in objs if o['kind'] == 'PodDisruptionBudget'); p['spec']['selector']['matchLabels']['app.kubernetes.io/component'] = 'api'"
must_fail_check "the store URL as a literal" "given as a literal value" \
  "$c['env'] = [{'name': 'STRATAD_STORE_URL', 'value': 'postgresql://strata:hunter2@db/strata'}]"
api='next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "strata-api")'
must_fail_check "an API pod with a hostPath" "a hostPath volume (an API process" \
  "$api['spec']['template']['spec']['volumes'].append({'name': 'kvm', 'hostPath': {'path': '/dev/kvm', 'type': 'CharDevice'}})"
must_fail_check "an API pod without its role" "not started as role api" \
  "c0 = $api['spec']['template']['spec']['containers'][0]; c0['env'] = [e for e in c0['env'] if e['name'] != 'STRATAD_ROLE']"
must_fail_check "the API Service on the host pods" "selects pods other than the strata-api Deployment's" \
  "s = next(o for o in objs if o['kind'] == 'Service' and o['metadata']['name'] == 'strata-api'); s['spec']['selector'] = {'app.kubernetes.io/component': 'host'}"
must_fail_check "a Role granted" "needs no Kubernetes API access" \
  "objs.append({'apiVersion': 'rbac.authorization.k8s.io/v1', 'kind': 'Role', 'metadata': {'name': 'x', 'namespace': 'strata'}, 'rules': []})"
echo "k8s-validate: ok ($n kustomizations; self-checks rejected every broken copy)" >&2
