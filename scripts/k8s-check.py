#!/usr/bin/env python3
"""Checks what matters in a rendered strata kustomization (scripts/k8s-validate.sh).

The schema validation says the YAML is well-formed Kubernetes; this says it is
a strata deployment that can work: the host DaemonSet mounts what stratad's
own configuration (the ConfigMap's stratad.toml) points at, its probes hit
the daemon's /livez and /healthz on the port it listens on, the PDB and the
Services select the pods they mean, images are pinned, the PostgreSQL URL
comes from a Secret, nothing is granted Kubernetes API access, the hosts form
a cluster with an advertised address, and the API pods run role api without
privileges or hostPaths.

Usage: k8s-check.py RENDERED.yaml  (exit 1 with one line per failure)
"""

import re
import sys
import tomllib

import yaml

NAMESPACE = "strata"
STORE_ENV = "STRATAD_STORE_URL"


class Check:
    def __init__(self):
        self.failures = []

    def that(self, cond, msg):
        if not cond:
            self.failures.append(msg)
        return cond


def selects(selector, labels):
    """True when every key=value of `selector` is in `labels`."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_templates(objs):
    """(workload, pod template) of every Deployment and DaemonSet."""
    return [
        (o, o["spec"]["template"])
        for o in objs
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
    ]


def image_pinned(image):
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and not last.endswith(":latest")


def mount_of(container, volumes, path):
    """The volume mounted at `path` or at a parent of it: (mountPath, volume)."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") or "/"
        if path == mp or path.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) > len(best[0]):
                best = (mp, volumes.get(m["name"]))
    return best


def main(path):
    ck = Check()
    text = open(path, encoding="utf-8").read()
    objs = [o for o in yaml.safe_load_all(text) if o]
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)

    # A password never sits in the manifests: the URL is a Secret's.
    ck.that(
        not re.search(r"postgres(ql)?://[^\s\"'@/]*:[^\s\"'@/]*@", text),
        "a PostgreSQL URL with a password is in the rendered YAML (it belongs in the Secret)",
    )

    # One namespace, allowed to run privileged pods.
    for o in objs:
        if o["kind"] == "Namespace":
            continue
        ns = o["metadata"].get("namespace")
        ck.that(ns == NAMESPACE, f"{o['kind']}/{o['metadata']['name']}: namespace {ns!r}, not {NAMESPACE!r}")
    nss = by_kind.get("Namespace", [])
    ck.that(
        any(
            n["metadata"]["name"] == NAMESPACE
            and n["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") == "privileged"
            for n in nss
        ),
        f"Namespace {NAMESPACE} with pod-security.kubernetes.io/enforce=privileged is missing",
    )

    # RBAC: stratad does not call the Kubernetes API (docs/kubernetes.md).
    for kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        ck.that(kind not in by_kind, f"{kind} present: stratad needs no Kubernetes API access (docs/kubernetes.md, RBAC)")
    sas = {o["metadata"]["name"] for o in by_kind.get("ServiceAccount", [])}
    for sa in by_kind.get("ServiceAccount", []):
        ck.that(sa.get("automountServiceAccountToken") is False, f"ServiceAccount/{sa['metadata']['name']}: token automounted")

    configmaps = {o["metadata"]["name"]: o for o in by_kind.get("ConfigMap", [])}
    templates = pod_templates(objs)

    for wl, tpl in templates:
        who = f"{wl['kind']}/{wl['metadata']['name']}"
        labels = tpl["metadata"].get("labels", {})
        ck.that(selects(wl["spec"]["selector"].get("matchLabels"), labels), f"{who}: its selector does not select its pods")
        spec = tpl["spec"]
        ck.that(spec.get("serviceAccountName") in sas, f"{who}: serviceAccountName {spec.get('serviceAccountName')!r} not rendered")
        ck.that(spec.get("automountServiceAccountToken") is False, f"{who}: service account token mounted")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            cname = f"{who} container {c['name']}"
            ck.that(image_pinned(c["image"]), f"{cname}: image {c['image']!r} is not pinned (a tag other than latest, or a digest)")
            req = c.get("resources", {}).get("requests", {})
            ck.that("cpu" in req and "memory" in req, f"{cname}: no cpu and memory requests")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for probe, want in (("livenessProbe", "/livez"), ("readinessProbe", "/healthz")):
                p = c.get(probe)
                if not ck.that(p and "httpGet" in p, f"{cname}: no {probe} (httpGet)"):
                    continue
                ck.that(p["httpGet"]["path"] == want, f"{cname}: {probe} on {p['httpGet']['path']}, not {want}")
                port = p["httpGet"]["port"]
                ck.that(port in ports or port in ports.values(), f"{cname}: {probe} port {port!r} is no containerPort")
            ck.that(
                not any(e.get("name") == STORE_ENV and "value" in e for e in c.get("env", [])),
                f"{cname}: {STORE_ENV} given as a literal value (use the Secret)",
            )
            ck.that(
                any(
                    e.get("name") == STORE_ENV and e.get("valueFrom", {}).get("secretKeyRef", {}).get("key")
                    for e in c.get("env", [])
                ),
                f"{cname}: {STORE_ENV} does not come from a Secret (secretKeyRef)",
            )
            # The daemon's configuration, as it will read it.
            cfg = None
            cfg_mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == "/etc/strata/stratad.toml"), None)
            args = " ".join(c.get("args", []))
            ck.that("--config=/etc/strata/stratad.toml" in args, f"{cname}: not started with --config=/etc/strata/stratad.toml")
            if ck.that(cfg_mount is not None, f"{cname}: nothing mounted at /etc/strata/stratad.toml"):
                v = volumes.get(cfg_mount["name"], {})
                cm = configmaps.get(v.get("configMap", {}).get("name"))
                key = cfg_mount.get("subPath")
                if ck.that(cm is not None and key in cm.get("data", {}), f"{cname}: its config volume names no rendered ConfigMap with {key!r}"):
                    try:
                        cfg = tomllib.loads(cm["data"][key])
                    except tomllib.TOMLDecodeError as e:
                        ck.that(False, f"{cname}: stratad.toml is not TOML: {e}")
            if cfg is None:
                continue
            ck.that("url" not in cfg.get("store", {}), f"{cname}: [store] url in the ConfigMap (it comes from the Secret)")
            listen = cfg.get("listen", "127.0.0.1:7070")
            lport = int(listen.rsplit(":", 1)[1])
            ck.that(not listen.startswith("127."), f"{cname}: listen {listen} is loopback: probes and Services cannot reach it")
            ck.that(lport in ports.values(), f"{cname}: listens on {lport}, containerPorts are {sorted(ports.values())}")
            if labels.get("app.kubernetes.io/component") == "api":
                # An API-only process (docs/cluster.md, "API processes"): in
                # the hosts' cluster, role api, and nothing of a host.
                ck.that(cfg.get("cluster", {}).get("enabled") is True, f"{cname}: [cluster] enabled is not true (an API process forwards to the cluster's hosts)")
                env = {e.get("name"): e for e in c.get("env", [])}
                ck.that(
                    env.get("STRATAD_ROLE", {}).get("value") == "api" or "--role=api" in args,
                    f"{cname}: not started as role api (STRATAD_ROLE=api or --role=api)",
                )
                sc = c.get("securityContext", {})
                ck.that(not sc.get("privileged"), f"{cname}: privileged (an API process needs no privilege)")
                ck.that(sc.get("allowPrivilegeEscalation") is False, f"{cname}: allowPrivilegeEscalation is not false")
                ck.that(
                    not any("hostPath" in v for v in volumes.values()),
                    f"{cname}: a hostPath volume (an API process has no pool, no node state, no /dev/kvm)",
                )
                continue
            if labels.get("app.kubernetes.io/component") != "host":
                continue
            ck.that(cfg.get("cluster", {}).get("enabled") is True, f"{cname}: [cluster] enabled is not true (the API pods forward to registered hosts)")
            env = {e.get("name"): e for e in c.get("env", [])}
            ck.that(
                "STRATAD_ADVERTISE_ADDRESS" in env or "address" in cfg.get("cluster", {}),
                f"{cname}: no advertised address (STRATAD_ADVERTISE_ADDRESS): http://<listen> = 0.0.0.0 reaches no one",
            )
            # The host: every path the daemon writes is mounted, the lasting
            # ones from the node.
            sc = c.get("securityContext", {})
            ck.that(sc.get("privileged") is True, f"{cname}: not privileged (docs/kubernetes.md lists why it must be)")
            ck.that("memory" not in c.get("resources", {}).get("limits", {}), f"{cname}: a memory limit would OOM-kill guests")
            for key, default, lasting in (
                ("data_dir", "/var/lib/strata", True),
                ("key_dir", "/etc/strata/keys", True),
                ("run_dir", "/run/strata", False),
            ):
                p = cfg.get(key, default)
                m = mount_of(c, volumes, p)
                if ck.that(m is not None and m[1] is not None, f"{cname}: {key} {p} is not on a mounted volume"):
                    if lasting:
                        ck.that("hostPath" in m[1], f"{cname}: {key} {p} is not on a hostPath (lost with the pod)")
            pool = cfg.get("pool_path")
            if pool:
                m = mount_of(c, volumes, pool)
                ck.that(
                    m is not None and m[1] is not None and m[1].get("hostPath", {}).get("type") == "Directory",
                    f"{cname}: pool_path {pool} is not the node's btrfs volume (hostPath, type Directory)",
                )
            else:
                # pool.img on a loop device: losetup needs the host's /dev.
                m = mount_of(c, volumes, "/dev/loop-control")
                ck.that(
                    m is not None and m[0] == "/dev" and m[1] is not None and m[1].get("hostPath", {}).get("path") == "/dev",
                    f"{cname}: no pool_path, so pool.img is loop-mounted, but the host's /dev is not mounted",
                )
            if cfg.get("accel", "auto") in ("kvm", "auto"):
                m = mount_of(c, volumes, "/dev/kvm")
                hp = (m[1] or {}).get("hostPath", {}) if m else {}
                ck.that(
                    (m is not None and m[0] == "/dev/kvm" and hp.get("path") == "/dev/kvm" and hp.get("type") == "CharDevice")
                    or (m is not None and m[0] == "/dev" and hp.get("path") == "/dev"),
                    f"{cname}: accel {cfg.get('accel', 'auto')} but /dev/kvm is not mounted from the host",
                )
            for probe in ("startupProbe",):
                ck.that(probe in c, f"{cname}: no {probe} (the first start opens the pool and migrates the store)")

    ds = [o for o in by_kind.get("DaemonSet", []) if o["spec"]["template"]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "host"]
    ck.that(len(ds) == 1, f"{len(ds)} host DaemonSets (want 1)")
    api = [o for o in by_kind.get("Deployment", []) if o["metadata"]["name"] == "strata-api"]
    if ck.that(len(api) == 1, "no strata-api Deployment"):
        ck.that(api[0]["spec"].get("replicas", 1) >= 1, "strata-api scaled to 0: no API process serves the Service strata-api")

    # The PDB selects the host pods, and only them.
    pdbs = by_kind.get("PodDisruptionBudget", [])
    ck.that(len(pdbs) >= 1, "no PodDisruptionBudget")
    for pdb in pdbs:
        sel = pdb["spec"]["selector"].get("matchLabels", {})
        hit = [wl["metadata"]["name"] for wl, t in templates if selects(sel, t["metadata"].get("labels", {}))]
        ck.that(
            any(d["metadata"]["name"] in hit for d in ds) and all(h in [d["metadata"]["name"] for d in ds] for h in hit),
            f"PodDisruptionBudget/{pdb['metadata']['name']} selects {hit}, not exactly the host DaemonSet's pods",
        )

    # Every Service selects pods that have its target port.
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        hit = [t for _, t in templates if selects(sel, t["metadata"].get("labels", {}))]
        sname = f"Service/{svc['metadata']['name']}"
        if not ck.that(hit, f"{sname} selects no pod template"):
            continue
        if svc["metadata"]["name"] == "strata-api":
            # The clients' address: the API processes, not the hosts.
            ck.that(
                all(t["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "api" for t in hit),
                f"{sname} selects pods other than the strata-api Deployment's",
            )
        else:
            ck.that(
                any(selects(sel, d["spec"]["template"]["metadata"].get("labels", {})) for d in ds),
                f"{sname} does not select the host pods",
            )
        for p in svc["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            for t in hit:
                names = {pp.get("name"): pp["containerPort"] for c in t["spec"]["containers"] for pp in c.get("ports", [])}
                ck.that(tp in names or tp in names.values(), f"{sname} targetPort {tp!r} is not a port of its pods")

    for f in ck.failures:
        print(f"k8s-check: {path}: {f}")
    return 1 if ck.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
