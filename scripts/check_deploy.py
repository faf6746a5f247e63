"""What scripts/check-deploy asks of deploy/ besides systemd-analyze and Docker.

Kubernetes (no API server, kubectl or kustomize can run here):
- every file under deploy/kubernetes but the kustomization files is one or more complete objects,
  valid against the Kubernetes API's schema (kubernetes-validate, strict: no unknown field);
- every kustomization.yaml only lists resources (no transformer, so `kubectl apply -k` renders
  exactly the files, and each file applies alone), lists every file beside it, and each overlay
  renders objects that find one another: a Service's and a budget's selectors meet a workload, a
  named port or volume exists, a referenced ServiceAccount, claim, role or namespace is rendered,
  and a Secret is either rendered or one deploy/README.md tells the operator to create.

Both (the flags are the binaries' own, read from their --help):
- every `--flag` a container or a unit passes, and every KILN_* variable it sets, is one the
  binary it runs knows. Flags another branch is adding are tolerated by name until they land.

Run by scripts/check-deploy with the venv's python, which has kubernetes-validate and PyYAML.
"""

import argparse
import pathlib
import re
import subprocess
import sys

import yaml
from kubernetes_validate import utils as kubernetes_validate

# The Kubernetes version whose schema every manifest must fit: the one the coordinator's
# k8s-openapi is built for (Cargo.toml, feature v1_33).
KUBERNETES_VERSION = "1.33.0"

# Secrets the operator creates (deploy/README.md says how); nothing in deploy/ defines them, since
# applying a placeholder would overwrite the real one.
OPERATOR_SECRETS = {"kiln-tls", "kiln-join", "kiln-postgres"}

# Flags being added on other branches (issue #12: the coordinator's HTTP listener for /metrics and
# the status page, the agent's metrics listener). Drop each from here once the binary has it.
PENDING_FLAGS: dict = {}

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}

failures = []


def fail(where, message):
    failures.append(f"{where}: {message}")


def documents(path):
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


# --- the binaries' flags -------------------------------------------------------------------------


class Binary:
    """A binary's flags and environment variables, as its --help lists them."""

    def __init__(self, path):
        self.name = pathlib.Path(path).name
        text = subprocess.run([path, "--help"], check=True, capture_output=True, text=True).stdout
        self.flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
        self.env = set(re.findall(r"\[env: ([A-Z0-9_]+)=", text))
        self.pending = PENDING_FLAGS.get(self.name, set())
        for flag in sorted(self.pending & self.flags):
            print(f"check-deploy: note: {self.name} has {flag} now; drop it from PENDING_FLAGS in {__file__}")

    def check_args(self, where, args):
        for arg in args:
            if not arg.startswith("--"):
                continue
            flag = arg.split("=", 1)[0]
            if flag not in self.flags and flag not in self.pending:
                fail(where, f"{self.name} has no flag {flag} (see `{self.name} --help`)")

    def check_env(self, where, names):
        for name in names:
            if name.startswith("KILN_") and name not in self.env:
                fail(where, f"{self.name} reads no variable {name} (see `{self.name} --help`)")


# --- Kubernetes ----------------------------------------------------------------------------------


def validate_schema(path):
    objects = []
    for doc in documents(path):
        items = doc.get("items", []) if doc.get("kind") == "List" else [doc]
        for obj in items:
            what = f"{path} ({obj.get('kind')} {obj.get('metadata', {}).get('name')})"
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as err:
                location = ".".join(str(p) for p in err.path)
                fail(what, f"not a valid object for Kubernetes {KUBERNETES_VERSION}: {location}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError as err:
                fail(what, f"{err.message} — not a Kubernetes object")
            objects.append(obj)
    if not objects:
        fail(path, "holds no object")
    return objects


def render(directory, objects_by_file, seen=()):
    """The objects `kubectl apply -k directory` would apply: its resources, in order."""
    directory = directory.resolve()
    kustomization = directory / "kustomization.yaml"
    if directory in seen:
        fail(kustomization, "includes itself")
        return []
    docs = documents(kustomization)
    spec = docs[0] if len(docs) == 1 else {}
    if spec.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or spec.get("kind") != "Kustomization":
        fail(kustomization, "not one kustomize.config.k8s.io/v1beta1 Kustomization")
    extra = set(spec) - KUSTOMIZATION_KEYS
    if extra:
        fail(kustomization, f"uses {sorted(extra)}: only `resources`, so every file also applies alone")
    listed = set()
    rendered = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            if not (target / "kustomization.yaml").is_file():
                fail(kustomization, f"{entry} is a directory without a kustomization.yaml")
                continue
            rendered += render(target, objects_by_file, seen + (directory,))
        elif target in objects_by_file:
            listed.add(target)
            rendered += [(target, obj) for obj in objects_by_file[target]]
        else:
            fail(kustomization, f"lists {entry}, which is not a manifest here")
    for path in sorted(directory.glob("*.yaml")):
        if path.name != "kustomization.yaml" and path.resolve() not in listed:
            fail(kustomization, f"does not list {path.name}: `kubectl apply -k` would leave it out")
    return rendered


def pod_spec(obj):
    return obj.get("spec", {}).get("template", {}).get("spec", {})


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_overlay(overlay, rendered, binaries):
    keys = {}
    for path, obj in rendered:
        meta = obj.get("metadata", {})
        key = (obj.get("kind"), meta.get("namespace"), meta.get("name"))
        if key in keys:
            fail(overlay, f"{key[0]} {key[2]} in both {keys[key]} and {path}")
        keys[key] = path
    def names(kind, namespace=None):
        return {
            obj["metadata"]["name"]
            for _, obj in rendered
            if obj.get("kind") == kind and obj["metadata"].get("namespace") == namespace
        }

    namespaces = names("Namespace")
    workloads = [(p, o) for p, o in rendered if o.get("kind") in WORKLOADS]

    for path, obj in rendered:
        kind, meta = obj.get("kind"), obj.get("metadata", {})
        ns = meta.get("namespace")
        where = f"{overlay}: {path.name} ({kind} {meta.get('name')})"
        if kind not in CLUSTER_SCOPED:
            if ns is None:
                fail(where, "no metadata.namespace: applied alone it would land in whatever namespace is current")
            elif ns not in namespaces:
                fail(where, f"namespace {ns} is not rendered")

        if kind in WORKLOADS:
            spec = obj["spec"]
            labels = spec["template"].get("metadata", {}).get("labels", {})
            if not selects(spec["selector"].get("matchLabels", {}), labels):
                fail(where, "its selector does not match its pod template's labels")
            check_pod(where, ns, pod_spec(obj), names, binaries)

        if kind == "Service":
            selector = obj["spec"].get("selector", {})
            targets = [pod_spec(o) for _, o in workloads if o["metadata"].get("namespace") == ns
                       and selects(selector, o["spec"]["template"].get("metadata", {}).get("labels", {}))]
            if not targets:
                fail(where, "selects no workload")
            ports = {p.get("name") for t in targets for c in t.get("containers", []) for p in c.get("ports", [])}
            for port in obj["spec"].get("ports", []):
                target = port.get("targetPort")
                if isinstance(target, str) and target not in ports:
                    fail(where, f"targetPort {target} is no container port of the workload it selects")

        if kind == "PodDisruptionBudget":
            selector = obj["spec"].get("selector", {}).get("matchLabels", {})
            if not any(selects(selector, o["spec"]["template"].get("metadata", {}).get("labels", {}))
                       for _, o in workloads if o["metadata"].get("namespace") == ns):
                fail(where, "selects no workload")

        if kind in ("ClusterRoleBinding", "RoleBinding"):
            ref = obj["roleRef"]
            role_ns = None if ref["kind"] == "ClusterRole" else ns
            if ref["name"] not in names(ref["kind"], role_ns):
                fail(where, f"binds {ref['kind']} {ref['name']}, which is not rendered")
            for subject in obj.get("subjects", []):
                if subject["kind"] == "ServiceAccount" and subject["name"] not in names(
                        "ServiceAccount", subject.get("namespace", ns)):
                    fail(where, f"binds ServiceAccount {subject['name']}, which is not rendered")


def check_pod(where, ns, spec, names, binaries):
    account = spec.get("serviceAccountName")
    if account and account not in names("ServiceAccount", ns):
        fail(where, f"runs as ServiceAccount {account}, which is not rendered")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    secrets = names("Secret", ns) | OPERATOR_SECRETS
    for volume in volumes.values():
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim and claim not in names("PersistentVolumeClaim", ns):
            fail(where, f"claims {claim}, which is not rendered")
        secret = volume.get("secret", {}).get("secretName")
        if secret and secret not in secrets:
            fail(where, f"mounts Secret {secret}: neither rendered nor one the README has the operator create")
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        cwhere = f"{where} container {container['name']}"
        command = container.get("command") or ["/usr/local/bin/kiln-coordinator"]  # the image's entrypoint
        binary = binaries.get(pathlib.Path(command[0]).name)
        if binary is None:
            fail(cwhere, f"runs {command[0]}, which is no Kiln binary")
        else:
            binary.check_args(cwhere, command[1:] + container.get("args", []))
            binary.check_env(cwhere, [e["name"] for e in container.get("env", [])])
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] not in secrets:
                fail(cwhere, f"reads Secret {ref['name']}: neither rendered nor one the README has the operator create")
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                fail(cwhere, f"mounts volume {mount['name']}, which the pod does not have")
        ports = container.get("ports", [])
        for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(probe_name)
            if not probe:
                continue
            for handler in ("grpc", "tcpSocket", "httpGet"):
                port = probe.get(handler, {}).get("port")
                if port is None:
                    continue
                known = {p.get("name") for p in ports} if isinstance(port, str) else {p["containerPort"] for p in ports}
                if port not in known:
                    fail(cwhere, f"{probe_name} probes port {port}, which the container does not declare")
        for key in ("limits", "requests"):
            if not container.get("resources", {}).get(key):
                fail(cwhere, f"no resource {key}")
        context = container.get("securityContext", {})
        if context.get("capabilities", {}).get("drop") != ["ALL"] or context.get("allowPrivilegeEscalation") is not False:
            fail(cwhere, "must drop ALL capabilities and disallow privilege escalation")
    if spec.get("securityContext", {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
        fail(where, "no RuntimeDefault seccomp profile")


def check_kubernetes(root, binaries):
    manifests = [p for p in sorted(root.rglob("*.yaml")) if p.name != "kustomization.yaml"]
    objects_by_file = {p.resolve(): validate_schema(p) for p in manifests}
    overlays = sorted(p.parent for p in (root / "overlays").glob("*/kustomization.yaml"))
    if not overlays:
        fail(root, "no overlays/*/kustomization.yaml")
    rendered_files = set()
    for overlay in overlays:
        rendered = render(overlay, objects_by_file)
        rendered_files |= {path for path, _ in rendered}
        check_overlay(overlay, rendered, binaries)
        print(f"check-deploy: {overlay} renders {len(rendered)} objects")
    for path in objects_by_file:
        if path not in rendered_files:
            fail(path, "in no overlay")
    print(f"check-deploy: {len(manifests)} manifests valid against Kubernetes {KUBERNETES_VERSION}")


# --- systemd -------------------------------------------------------------------------------------


def check_units(directory, binaries):
    for unit in sorted(directory.glob("*.service")):
        text = unit.read_text()
        execs = re.findall(r"^ExecStart=(\S+)(.*)$", text, re.M)
        if len(execs) != 1:
            fail(unit, "not exactly one ExecStart=")
            continue
        program, rest = execs[0]
        binary = binaries.get(pathlib.Path(program).name)
        if binary is None:
            fail(unit, f"runs {program}, which is no Kiln binary")
            continue
        binary.check_args(unit, rest.split())
        # Commented-out settings count: they are what the unit tells an operator to set.
        names = re.findall(r"^#?Environment=([A-Z0-9_]+)=", text, re.M)
        binary.check_env(unit, names)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", action="append", required=True, help="a Kiln binary whose --help is the truth")
    parser.add_argument("--kubernetes", type=pathlib.Path, required=True)
    parser.add_argument("--systemd", type=pathlib.Path, required=True)
    args = parser.parse_args()
    binaries = {b.name: b for b in map(Binary, args.binary)}
    check_kubernetes(args.kubernetes, binaries)
    check_units(args.systemd, binaries)
    if failures:
        for failure in failures:
            print(f"check-deploy: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
