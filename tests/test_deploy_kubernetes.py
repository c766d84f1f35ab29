"""deploy/kubernetes, validated offline: the overlays render, every manifest validates, and the
manifests agree with the code they deploy.

No `kustomize` binary is available here (and PyPI has no Python renderer of kustomization files),
so the overlays are rendered by `Kustomization` below: a small implementation of exactly the
subset of kustomize the overlays use, following kustomize's documented semantics —
`resources` (files inside the kustomization's folder, or other kustomization folders),
`configMapGenerator` (files and literals, with `generatorOptions.disableNameSuffixHash: true`),
`patches` (strategic-merge patches by kind and name: maps merge, the list fields Kubernetes merges
by key are merged by key, other lists and every list of a custom resource are replaced), then the
built-in transformers in kustomize's order: `namespace`, `labels` (with `includeSelectors: false`),
`replicas`, `images`. Any other kustomization field is an error, so an overlay cannot rely on a
feature this renderer would silently ignore.

Built-in kinds are validated with `kubernetes-validate` (the strict schemas: unknown fields are
errors) against the oldest and newest Kubernetes versions evalbus supports; KEDA's ScaledObject and
TriggerAuthentication and the Prometheus Operator's ServiceMonitor against the JSON Schema subsets
in `tests/deploy_schemas/` (written from their documented CRDs). Every rendered kind must be
covered by one of them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from evalbus_collector.service import CollectorSettings
from evalbus_contracts import streams
from evalbus_dispatcher.service import DispatcherSettings
from evalbus_exporter.service import ExporterSettings
from evalbus_gateway.settings import GatewaySettings
from evalbus_judge.service import JudgeSettings
from evalbus_runtime import ServiceSettings, load_settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SCHEMAS = Path(__file__).with_name("deploy_schemas")
OVERLAYS = ("dev", "prod")
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
"""Oldest and newest Kubernetes the manifests are validated against (docs/deploy.md)."""

SERVICES: dict[str, type[ServiceSettings]] = {
    "gateway": GatewaySettings,
    "dispatcher": DispatcherSettings,
    "collector": CollectorSettings,
    "judge": JudgeSettings,
    "exporter": ExporterSettings,
}

Doc = dict[str, Any]


class KustomizeError(Exception):
    """A kustomization this renderer cannot (or kustomize would not) render."""


# ------------------------------------------------------------------ the renderer

_KUSTOMIZATION_FIELDS = frozenset(
    {
        "apiVersion",
        "kind",
        "namespace",
        "labels",
        "resources",
        "images",
        "replicas",
        "patches",
        "configMapGenerator",
        "generatorOptions",
    }
)
_CLUSTER_SCOPED = frozenset(
    {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume", "StorageClass"}
)
_BUILTIN_GROUPS = frozenset(
    {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io"}
)
_WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "topologySpreadConstraints": "topologyKey",
}
"""Lists Kubernetes' strategic merge patch merges by key (`patchMergeKey` in the API types); the
container `ports` merge by `containerPort`, a Service's by `port`; every other list is replaced."""


def _group(doc: Doc) -> str:
    api_version = str(doc.get("apiVersion", ""))
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def _id(doc: Doc) -> tuple[str, str]:
    return str(doc["kind"]), str(doc["metadata"]["name"])


def strategic_merge(base: Any, patch: Any, *, builtin: bool, path: tuple[str, ...] = ()) -> Any:
    """`patch` merged into `base` as kustomize's strategic merge does (JSON merge patch semantics
    for custom resources: their lists are replaced)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(str(k).startswith("$") for k in patch):
            raise KustomizeError(f"patch directives are not supported: {sorted(patch)} at {'.'.join(path)}")
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, builtin=builtin, path=(*path, key))
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list) and builtin:
        key = _list_merge_key(path)
        if key is not None and all(isinstance(x, dict) and key in x for x in (*base, *patch)):
            out = [copy.deepcopy(x) for x in base]
            for item in patch:
                at = next((i for i, x in enumerate(out) if x[key] == item[key]), None)
                if at is None:
                    out.append(copy.deepcopy(item))
                else:
                    out[at] = strategic_merge(out[at], item, builtin=builtin, path=(*path, str(item[key])))
            return out
    return copy.deepcopy(patch)


def _list_merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1] if path else ""
    if field == "ports":
        return "port" if path == ("spec", "ports") else "containerPort"
    return _MERGE_KEYS.get(field)


def _pod_specs(doc: Doc) -> Iterator[Doc]:
    spec = doc.get("spec") or {}
    if doc["kind"] in _WORKLOADS:
        yield spec["template"]["spec"]
    elif doc["kind"] == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]


def _label_targets(doc: Doc, include_templates: bool) -> Iterator[Doc]:
    """The label maps kustomize's `labels` sets (metadataLabelsFieldSpecs when templates are included)."""
    yield doc.setdefault("metadata", {}).setdefault("labels", {})
    if not include_templates:
        return
    spec = doc.get("spec") or {}
    if doc["kind"] in _WORKLOADS:
        yield spec["template"].setdefault("metadata", {}).setdefault("labels", {})
    if doc["kind"] == "StatefulSet":
        for claim in spec.get("volumeClaimTemplates", []):
            yield claim.setdefault("metadata", {}).setdefault("labels", {})
    if doc["kind"] == "CronJob":
        yield spec["jobTemplate"].setdefault("metadata", {}).setdefault("labels", {})
        yield spec["jobTemplate"]["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {})


def _image_name(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


@dataclass(frozen=True)
class Kustomization:
    """One kustomization folder."""

    root: Path

    def spec(self) -> Doc:
        """The kustomization file, checked against the supported subset."""
        doc = yaml.safe_load((self.root / "kustomization.yaml").read_text(encoding="utf-8"))
        if not isinstance(doc, dict):
            raise KustomizeError(f"{self.root}: kustomization.yaml is not a mapping")
        unknown = set(doc) - _KUSTOMIZATION_FIELDS
        if unknown:
            raise KustomizeError(f"{self.root}: kustomization fields not supported here: {sorted(unknown)}")
        return doc

    def _inside(self, name: str) -> Path:
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise KustomizeError(f"{self.root}: {name} is outside the kustomization (kustomize's load restrictor)")
        return path

    def build(self) -> list[Doc]:
        """The rendered resources, in kustomize's order of operations."""
        k = self.spec()
        docs: list[Doc] = []
        for entry in k.get("resources", []):
            target = (self.root / entry).resolve()
            if target.is_dir():
                docs += Kustomization(target).build()
            else:
                docs += [d for d in yaml.safe_load_all(self._inside(entry).read_text(encoding="utf-8")) if d]
        docs += self._generate(k)
        ids = [_id(d) for d in docs]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise KustomizeError(f"{self.root}: resources defined twice: {duplicates}")
        for entry in k.get("patches", []):
            self._patch(docs, entry)
        if "namespace" in k:
            for doc in docs:
                if doc["kind"] not in _CLUSTER_SCOPED:
                    doc["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            if entry.get("includeSelectors", False):
                raise KustomizeError(f"{self.root}: labels with includeSelectors are not supported")
            for doc in docs:
                for labels in _label_targets(doc, bool(entry.get("includeTemplates", False))):
                    labels.update(entry["pairs"])
        for entry in k.get("replicas", []):
            found = [d for d in docs if d["metadata"]["name"] == entry["name"] and d["kind"] in _WORKLOADS]
            if not found:
                raise KustomizeError(f"{self.root}: replicas: no workload named {entry['name']}")
            for doc in found:
                doc["spec"]["replicas"] = int(entry["count"])
        for entry in k.get("images", []):
            self._image(docs, entry)
        return docs

    def _generate(self, k: Doc) -> list[Doc]:
        options = k.get("generatorOptions", {})
        if k.get("configMapGenerator") and options.get("disableNameSuffixHash") is not True:
            raise KustomizeError(f"{self.root}: generated names need disableNameSuffixHash: true here")
        out: list[Doc] = []
        for gen in k.get("configMapGenerator", []):
            if gen.get("behavior", "create") != "create" or set(gen) - {"name", "files", "literals", "options"}:
                raise KustomizeError(f"{self.root}: configMapGenerator {gen.get('name')}: unsupported fields")
            data: dict[str, str] = {}
            for item in gen.get("files", []):
                key, _, name = item.rpartition("=")
                path = self._inside(name)
                data[key or path.name] = path.read_text(encoding="utf-8")
            for item in gen.get("literals", []):
                key, _, value = item.partition("=")
                data[key] = value
            labels = {**options.get("labels", {}), **gen.get("options", {}).get("labels", {})}
            meta: Doc = {"name": gen["name"]}
            if labels:
                meta["labels"] = dict(labels)
            out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
        return out

    def _patch(self, docs: list[Doc], entry: Doc) -> None:
        if set(entry) != {"path"}:
            raise KustomizeError(
                f"{self.root}: only `patches: - path:` (strategic merge by kind and name) is supported"
            )
        for patch in yaml.safe_load_all(self._inside(entry["path"]).read_text(encoding="utf-8")):
            if not patch:
                continue
            targets = [i for i, d in enumerate(docs) if _id(d) == _id(patch)]
            if len(targets) != 1:
                raise KustomizeError(f"{self.root}: patch {_id(patch)} matches {len(targets)} resources")
            at = targets[0]
            docs[at] = strategic_merge(docs[at], patch, builtin=_group(docs[at]) in _BUILTIN_GROUPS)

    def _image(self, docs: list[Doc], entry: Doc) -> None:
        matched = False
        for doc in docs:
            for pod in _pod_specs(doc):
                for container in (*pod.get("initContainers", []), *pod.get("containers", [])):
                    if _image_name(container["image"]) != entry["name"]:
                        continue
                    matched = True
                    image = str(entry.get("newName", entry["name"]))
                    if "digest" in entry:
                        image += "@" + entry["digest"]
                    elif "newTag" in entry:
                        image += ":" + str(entry["newTag"])
                    container["image"] = image
        if not matched:
            raise KustomizeError(f"{self.root}: images: nothing uses {entry['name']}")


@cache
def _rendered(overlay: str) -> tuple[str, ...]:
    return tuple(json.dumps(d) for d in Kustomization(KUBERNETES / "overlays" / overlay).build())


def render(overlay: str) -> list[Doc]:
    """The overlay's manifests (a fresh copy each call)."""
    return [json.loads(d) for d in _rendered(overlay)]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    """The one resource of `kind` named `name`."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    """Every resource of `kind`."""
    return [d for d in docs if d["kind"] == kind]


# ------------------------------------------------------------------ the renderer itself


def test_strategic_merge_merges_keyed_lists_and_replaces_the_others() -> None:
    base = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}, {"name": "L", "value": "2"}]},
                        {"name": "b", "image": "y", "args": ["--one"]},
                    ]
                }
            }
        }
    }
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "a", "env": [{"name": "L", "value": "3"}, {"name": "M", "value": "4"}]},
                        {"name": "b", "args": ["--two"]},
                    ]
                }
            }
        }
    }
    merged = strategic_merge(base, patch, builtin=True)
    a, b = merged["spec"]["template"]["spec"]["containers"]
    assert a["image"] == "x"
    assert a["env"] == [{"name": "K", "value": "1"}, {"name": "L", "value": "3"}, {"name": "M", "value": "4"}]
    assert b["args"] == ["--two"]
    # custom resources: JSON merge patch semantics, a list is replaced whole
    so = strategic_merge(
        {"spec": {"triggers": [{"name": "t1"}, {"name": "t2"}]}},
        {"spec": {"triggers": [{"name": "t2"}]}},
        builtin=False,
    )
    assert so == {"spec": {"triggers": [{"name": "t2"}]}}
    assert strategic_merge({"a": 1, "b": 2}, {"a": None}, builtin=True) == {"b": 2}
    with pytest.raises(KustomizeError, match="directives"):
        strategic_merge({"a": {}}, {"a": {"$patch": "delete"}}, builtin=True)


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        Kustomization(tmp_path).build()
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator:\n  - name: c\n    literals: [a=b]\n")
    with pytest.raises(KustomizeError, match="disableNameSuffixHash"):
        Kustomization(tmp_path).build()
    (tmp_path / "kustomization.yaml").write_text(
        "generatorOptions: {disableNameSuffixHash: true}\nconfigMapGenerator:\n  - name: c\n    files: [../x]\n"
    )
    with pytest.raises(KustomizeError, match="outside"):
        Kustomization(tmp_path).build()


def test_image_names_ignore_tags_digests_and_keep_registry_ports() -> None:
    assert _image_name("evalbus/judge") == "evalbus/judge"
    assert _image_name("evalbus/judge:1.2") == "evalbus/judge"
    assert _image_name("registry:5000/evalbus/judge:1.2") == "registry:5000/evalbus/judge"
    assert _image_name("evalbus/judge@sha256:abc") == "evalbus/judge"


# ------------------------------------------------------------------ rendering and schemas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack(overlay: str) -> None:
    docs = render(overlay)
    namespace = "evalbus" if overlay == "prod" else f"evalbus-{overlay}"
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, _id(doc)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "evalbus", _id(doc)
    assert find(docs, "Namespace", namespace)
    for service in SERVICES:
        name = f"evalbus-{service}"
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "ScaledObject"):
            assert find(docs, kind, name)
        # the ScaledObject's HPA owns the replica count; a count in the manifest would reset it
        assert "replicas" not in find(docs, "Deployment", name)["spec"]
    nats = find(docs, "StatefulSet", "evalbus-nats")
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    headless = find(docs, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert find(docs, "Service", "evalbus-collector-otlp")["spec"]["ports"][0]["port"] == 4318
    assert len(of_kind(docs, "ServiceMonitor")) == 2
    assert find(docs, "ConfigMap", "evalbus-grafana-dashboard")["metadata"]["labels"]["grafana_dashboard"] == "1"


@cache
def _custom_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    out: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
    for path in sorted(SCHEMAS.glob("*.schema.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
        props = schema["properties"]
        out[(props["apiVersion"]["const"], props["kind"]["const"])] = jsonschema.Draft202012Validator(schema)
    return out


def validation_errors(doc: Doc, version: str) -> list[str]:
    """What is wrong with `doc` by its schema (built-in kinds: Kubernetes `version`)."""
    custom = _custom_validators().get((doc["apiVersion"], doc["kind"]))
    if custom is not None:
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in custom.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema: {e.message}"]
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_its_schema(overlay: str, version: str) -> None:
    problems = {f"{d['kind']}/{d['metadata']['name']}": validation_errors(d, version) for d in render(overlay)}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_schemas_catch_mistakes() -> None:
    docs = render("prod")
    so = copy.deepcopy(find(docs, "ScaledObject", "evalbus-judge"))
    so["spec"]["triggers"][0]["metadata"]["lagTreshold"] = "5"
    assert any("lagTreshold" in e for e in validation_errors(so, KUBERNETES_VERSIONS[0]))
    so = copy.deepcopy(find(docs, "ScaledObject", "evalbus-judge"))
    so["spec"]["minReplicas"] = 1
    assert validation_errors(so, KUBERNETES_VERSIONS[0])
    deployment = copy.deepcopy(find(docs, "Deployment", "evalbus-judge"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    assert validation_errors(deployment, KUBERNETES_VERSIONS[0])
    monitor = copy.deepcopy(of_kind(docs, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert validation_errors(monitor, KUBERNETES_VERSIONS[0])


# ------------------------------------------------------------------ consistency with the code


def _container(docs: list[Doc], service: str) -> Doc:
    pod = find(docs, "Deployment", f"evalbus-{service}")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == service
    return dict(container)


def _env(docs: list[Doc], container: Doc) -> dict[str, Doc]:
    """Every variable the container gets: its ConfigMaps (envFrom) overridden by its own env."""
    out: dict[str, Doc] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, "services take secrets by secretKeyRef, one key each"
        for key, value in find(docs, "ConfigMap", source["configMapRef"]["name"])["data"].items():
            out[key] = {"name": key, "value": value}
    for var in container.get("env", []):
        out[var["name"]] = var
    return out


def setting_keys(service: str) -> set[str]:
    """Environment variables the service's settings class reads (`<SERVICE>_<KEY>`, `<KEY>`, aliases)."""
    fields = set(SERVICES[service].__struct_fields__) - {"service"}
    keys = {f.upper() for f in fields} | {f"{service.upper()}_{f.upper()}" for f in fields}
    if "state_dir" in fields:
        keys.add("EVALBUS_STATE_DIR")
    return keys


RUNTIME_ENV = {"EVALBUS_SECRETS_DIR": REPO / "libs/runtime/src/evalbus_runtime/secrets.py"}
"""Variables read outside the settings classes, and the module that reads each."""


def test_runtime_env_vars_are_really_read_where_named() -> None:
    for var, module in RUNTIME_ENV.items():
        assert f'"{var}"' in module.read_text(encoding="utf-8"), f"{module} no longer reads {var}"


def _typed_value(settings: type[ServiceSettings], service: str, key: str, value: str) -> None:
    """Raise when `value` does not convert to the setting's type (as the service would at start)."""
    load_settings(settings, service, {key: value})


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_env_var_is_a_setting_of_its_service(overlay: str, service: str) -> None:
    docs = render(overlay)
    env = _env(docs, _container(docs, service))
    unknown = set(env) - setting_keys(service) - set(RUNTIME_ENV)
    assert unknown == set(), f"{service}: not settings of {SERVICES[service].__name__}: {sorted(unknown)}"
    for key, var in env.items():
        if "value" in var and key not in RUNTIME_ENV:
            _typed_value(SERVICES[service], service, key, str(var["value"]))


SECRET_ENV = {"NATS_URL", "DATABASE_URL", "GATEWAY_ADMIN_TOKEN"}
"""Variables whose value is a credential: only ever from a Secret by secretKeyRef."""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_credentials_come_from_secrets_never_from_a_manifest(overlay: str) -> None:
    docs = render(overlay)
    assert of_kind(docs, "Secret") == []
    for service, settings in SERVICES.items():
        env = _env(docs, _container(docs, service))
        secret_fields = {f.upper() for f in settings.SECRET_FIELDS}
        for key, var in env.items():
            bare = key.removeprefix(f"{service.upper()}_")
            if bare in secret_fields or key in SECRET_ENV:
                assert "value" not in var, f"{service}: {key} has a value in the manifest"
                assert set(var["valueFrom"]) == {"secretKeyRef"}, f"{service}: {key} not from a Secret"
        assert "secretKeyRef" in env["NATS_URL"]["valueFrom"]
    gateway = _env(docs, _container(docs, "gateway"))
    assert gateway["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "evalbus-database", "key": "url"}
    assert gateway["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "evalbus-gateway"


def _shutdown_timeout(env: dict[str, Doc], service: str) -> float:
    for key in (f"{service.upper()}_SHUTDOWN_TIMEOUT_S", "SHUTDOWN_TIMEOUT_S"):
        if key in env:
            return float(env[key]["value"])
    return float(ServiceSettings().shutdown_timeout_s)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_pods_are_probed_bounded_and_outlive_their_shutdown_timeout(overlay: str, service: str) -> None:
    docs = render(overlay)
    pod = find(docs, "Deployment", f"evalbus-{service}")["spec"]["template"]["spec"]
    container = _container(docs, service)
    env = _env(docs, container)
    http_port = int(env["HTTP_PORT"]["value"])
    assert env["HTTP_HOST"]["value"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == http_port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}, f"{service}: {kind}"
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= sleep_s + _shutdown_timeout(env, service) + 10, f"{service}: {grace} s grace is too short"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    service_doc = find(docs, "Service", f"evalbus-{service}")
    assert {"name": "http", "port": service_doc["spec"]["ports"][0]["port"], "targetPort": "http"} in service_doc[
        "spec"
    ]["ports"]
    pdb = find(docs, "PodDisruptionBudget", f"evalbus-{service}")
    labels = find(docs, "Deployment", f"evalbus-{service}")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service_doc["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_collector_receives_otlp_on_every_address(overlay: str) -> None:
    docs = render(overlay)
    container = _container(docs, "collector")
    env = _env(docs, container)
    assert env["COLLECTOR_OTLP_HOST"]["value"] == "0.0.0.0"
    port = int(env["COLLECTOR_OTLP_PORT"]["value"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["otlp"] == port
    otlp = find(docs, "Service", "evalbus-collector-otlp")
    assert otlp["spec"]["ports"] == [{"name": "otlp-http", "port": 4318, "targetPort": "otlp"}]


def _consumer(durable: str) -> streams.ConsumerDef:
    found = [c for c in streams.CONSUMERS if c.durable == durable]
    assert found, f"no consumer {durable} in evalbus_contracts.streams"
    return found[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_scale_each_service_on_its_own_consumers(overlay: str) -> None:
    docs = render(overlay)
    auth = find(docs, "TriggerAuthentication", "evalbus-nats-monitoring")
    params = {ref["parameter"]: ref for ref in auth["spec"]["configMapTargetRef"]}
    assert set(params) == {"natsServerMonitoringEndpoint", "account"}
    keda = find(docs, "ConfigMap", params["natsServerMonitoringEndpoint"]["name"])["data"]
    nats = find(docs, "StatefulSet", "evalbus-nats")
    headless = find(docs, "Service", nats["spec"]["serviceName"])
    namespace = headless["metadata"]["namespace"]
    monitor = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["monitor"]
    # KEDA runs in its own namespace: the endpoint is the full name of this namespace's NATS; the
    # headless Service, because on a cluster the scaler reaches each node as <pod>.<endpoint host>.
    endpoint = f"{headless['metadata']['name']}.{namespace}.svc.cluster.local:{monitor}"
    assert keda[params["natsServerMonitoringEndpoint"]["key"]] == endpoint
    assert keda[params["account"]["key"]] == "EVALBUS"
    for so in of_kind(docs, "ScaledObject"):
        spec = so["spec"]
        target = spec["scaleTargetRef"]["name"]
        assert find(docs, "Deployment", target)
        service = target.removeprefix("evalbus-")
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "nats-jetstream"
            assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
            consumer = _consumer(trigger["metadata"]["consumer"])
            assert trigger["metadata"]["stream"] == consumer.stream
            assert consumer.durable.split("-", 1)[0] == service, (
                f"{target} scales on another service's {consumer.durable}"
            )


def test_every_stage_consumer_is_scaled_on_except_the_held_and_side_ones() -> None:
    scaled = {
        t["metadata"]["consumer"] for so in of_kind(render("prod"), "ScaledObject") for t in so["spec"]["triggers"]
    }
    # collector-spans holds its messages while traces assemble (its lag is work in hand);
    # collector-dead-letters is a side read of the DLQ.
    assert scaled == {c.durable for c in streams.CONSUMERS} - {"collector-spans", "collector-dead-letters"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_nats_cluster_runs_the_tested_config(overlay: str) -> None:
    docs = render(overlay)
    nats = find(docs, "StatefulSet", "evalbus-nats")
    pod = nats["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "nats")
    config = find(docs, "ConfigMap", "evalbus-nats-config")
    mount = next(m for m in server["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert server["args"] == ["--config", f"{mount}/nats.conf"]
    assert config["data"]["nats.conf"] == (DEPLOY / "nats/kubernetes.conf").read_text(encoding="utf-8")
    assert {"jetstream.conf", "accounts.conf"} <= set(config["data"])
    for host in re.findall(r"nats://([a-z0-9-]+)\.([a-z0-9-]+):6222", config["data"]["nats.conf"]):
        assert host[1] == nats["spec"]["serviceName"]
        assert int(host[0].rsplit("-", 1)[1]) < nats["spec"]["replicas"]
    env = {e["name"] for e in server["env"]}
    assert {"SERVER_NAME", "NATS_STORE_DIR", "NATS_MAX_FILE_STORE", "NATS_PID_FILE"} <= env
    assert server["envFrom"] == [{"secretRef": {"name": "evalbus-nats-users"}}]
    pid_file = next(e["value"] for e in server["env"] if e["name"] == "NATS_PID_FILE")
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["nats-server", "--signal", f"ldm={pid_file}"]
    assert pod["terminationGracePeriodSeconds"] > 30 + 10  # lame duck duration + grace period
    store = next(e["value"] for e in server["env"] if e["name"] == "NATS_MAX_FILE_STORE")
    claim = nats["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert _bytes(store) < _bytes(claim), "JetStream may fill more than its volume"
    go_limit = next(e["value"] for e in server["env"] if e["name"] == "GOMEMLIMIT")
    assert _bytes(go_limit.removesuffix("B")) < _bytes(server["resources"]["limits"]["memory"])
    assert find(docs, "PodDisruptionBudget", "evalbus-nats")["spec"]["maxUnavailable"] == 1


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity)
    assert match, quantity
    return float(match[1]) * units.get(match[2], 1)


# ------------------------------------------------------------------ the dashboard


def exported_metrics() -> set[str]:
    """Every Prometheus series name the services' code defines, with the suffixes Prometheus adds."""
    pattern = re.compile(r"\b(Counter|Histogram|Gauge)\(\s*\"([a-z_:][a-z0-9_:]*)\"")
    names: set[str] = set()
    for root in ("libs", "services"):
        for path in (REPO / root).rglob("*.py"):
            if "/tests/" in path.as_posix():
                continue
            for kind, name in pattern.findall(path.read_text(encoding="utf-8")):
                if kind == "Counter":
                    names.add(name if name.endswith("_total") else name + "_total")
                elif kind == "Histogram":
                    names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                else:
                    names.add(name)
    return names


NATS_EXPORTER_METRICS = {
    "jetstream_consumer_num_pending",
    "jetstream_consumer_num_ack_pending",
    "jetstream_consumer_num_redelivered",
    "jetstream_stream_total_messages",
}
"""Series of the Prometheus NATS exporter (`-jsz all`, collector/jsz.go) the dashboard reads: the
services do not export consumer lag themselves."""

PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "by", "without", "histogram_quantile",
    "le", "on", "ignoring", "label_values", "and", "or", "unless", "deriv", "absent_over_time",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression (selectors, ranges and strings removed; the words left
    that name evalbus or JetStream series, or Prometheus' own `up`)."""
    bare = re.sub(r"\{[^}]*\}|\[[^]]*\]|\"[^\"]*\"", " ", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - PROMQL_WORDS
    return {w for w in words if w.startswith(("evalbus_", "jetstream_")) or w == "up"}


def dashboard_metrics(dashboard: Doc) -> set[str]:
    """Metric names in the dashboard's queries."""
    return {m for panel in dashboard["panels"] for t in panel.get("targets", []) for m in promql_metrics(t["expr"])}


def test_the_dashboard_reads_only_metrics_that_exist() -> None:
    dashboard = json.loads((DEPLOY / "dashboards/evalbus.json").read_text(encoding="utf-8"))
    used = dashboard_metrics(dashboard)
    assert used - exported_metrics() - NATS_EXPORTER_METRICS == set()
    # the panels the issue asks for
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "lag", "dlq", "judge latency", "sandbox hold"):
        assert topic in titles, topic
    assert {"evalbus_published_total", "evalbus_handle_seconds_bucket", "evalbus_dead_letters_total"} <= used
    assert {"jetstream_consumer_num_pending", "jetstream_stream_total_messages"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]


def test_the_nats_exporter_is_scraped_where_the_dashboard_expects_it() -> None:
    docs = render("prod")
    pod = find(docs, "StatefulSet", "evalbus-nats")["spec"]["template"]["spec"]
    exporter = next(c for c in pod["containers"] if c["name"] == "exporter")
    assert "-jsz" in exporter["args"]
    assert exporter["args"][exporter["args"].index("-jsz") + 1] == "all"
    monitors = {m["metadata"]["name"]: m for m in of_kind(docs, "ServiceMonitor")}
    nats_monitor = monitors["evalbus-nats"]["spec"]
    scraped = [
        s
        for s in of_kind(docs, "Service")
        if nats_monitor["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in scraped] == ["evalbus-nats-headless"]
    assert nats_monitor["endpoints"][0]["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}
    services_monitor = monitors["evalbus"]["spec"]
    names = [
        s["metadata"]["name"]
        for s in of_kind(docs, "Service")
        if services_monitor["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert sorted(names) == sorted(f"evalbus-{s}" for s in SERVICES)


def test_the_operator_guide_states_the_scaling_the_manifests_do() -> None:
    guide = (REPO / "docs/deploy.md").read_text(encoding="utf-8")
    for so in of_kind(render("prod"), "ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            meta = trigger["metadata"]
            row = f"`{meta['consumer']}` ({meta['stream']}) | {meta['lagThreshold']} |"
            assert row in guide, f"docs/deploy.md's scaling table lacks {row}"


def test_alerts_read_only_metrics_that_exist() -> None:
    (rules,) = of_kind(render("prod"), "PrometheusRule")
    alerts = [r for group in rules["spec"]["groups"] for r in group["rules"]]
    used: set[str] = set()
    for rule in alerts:
        metrics = promql_metrics(rule["expr"])
        assert metrics, rule["alert"]
        used |= metrics
    assert used - exported_metrics() - NATS_EXPORTER_METRICS - {"up"} == set()
    jobs = set(re.findall(r'up\{job="([^"]+)"\}', " ".join(r["expr"] for r in alerts)))
    assert jobs == {f"evalbus-{s}" for s in SERVICES}, "the service-down alert covers every service's Service"
    names = [r["alert"] for r in alerts]
    assert len(names) == len(set(names))
