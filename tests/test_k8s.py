"""Offline checks of the cluster manifests in k8s/: no cluster, no network.

* every YAML document (except the Helm values file) validates against the
  Kubernetes 1.30 OpenAPI schemas, strictly (unknown fields fail), with the
  `kubernetes_validate` package;
* security properties: no credential outside the Secret template, non-root pods,
  resources on every container, namespace-scoped RBAC, NetworkPolicies around
  MLflow and its Postgres;
* the GPU pod templates tolerate nvidia.com/gpu and mount a memory-backed /dev/shm;
* cross-file consistency: every Secret / ConfigMap / PodTemplate / namespace that
  something refers to is defined;
* the flyte-binary Helm values parse and enable Flyte's PyTorch plugin.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from dapo.config import DAPOConfig
from images import pins

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
HELM_VALUES = K8S / "flyte-binary-values.yaml"
SECRETS_EXAMPLE = K8S / "secrets.example.yaml"
README = K8S / "README.md"
K8S_VERSION = "1.30"

WORKLOAD_NS = "dapo"
MLFLOW_URI = "http://mlflow.mlflow.svc.cluster.local:5000"

# Names of keys / env vars that carry credentials.
CRED_RE = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|ACCESS_KEY|KEY_ID|CREDENTIAL|PRIVATE_KEY|API_KEY)", re.I)
# user:password@ in a URI; both parts must be $(VAR) references to be allowed.
URI_USERINFO_RE = re.compile(r"://([^/@\s]+):([^/@\s]+)@")
VAR_REF_RE = re.compile(r"^\$\([A-Za-z_][A-Za-z0-9_]*\)$")

NAMESPACED_KINDS = {
    "ServiceAccount", "Role", "RoleBinding", "ResourceQuota", "LimitRange", "ConfigMap", "Secret",
    "Service", "Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod", "PodTemplate",
    "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


# --------------------------------------------------------------------------- helpers

def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != HELM_VALUES)


def applied_files() -> list[Path]:
    """The manifests meant for `kubectl apply` as they are (numbered ones)."""
    return sorted(p for p in K8S.glob("[0-9]*.yaml"))


def all_docs(files: list[Path] | None = None) -> list[tuple[str, dict]]:
    out = []
    for path in files if files is not None else manifest_files():
        for doc in _load_all(path):
            out.append((path.name, doc))
    return out


def _doc_id(fname: str, doc: dict) -> str:
    meta = doc.get("metadata") or {}
    return f"{fname}:{doc.get('kind')}/{meta.get('namespace', '-')}/{meta.get('name')}"


def pod_specs(doc: dict) -> list[dict]:
    kind = doc.get("kind")
    if kind in WORKLOAD_KINDS:
        return [doc["spec"]["template"]["spec"]]
    if kind == "CronJob":
        return [doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    if kind == "Pod":
        return [doc["spec"]]
    if kind == "PodTemplate":
        return [doc["template"]["spec"]]
    return []


def containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def walk_strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from walk_strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk_strings(item)


def walk_items(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, str, Any]]:
    """(path, key, value) for every mapping entry, recursively."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, str(key), value
            yield from walk_items(value, path + (key,))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from walk_items(item, path + (i,))


def find(kind: str, name: str, namespace: str | None = None) -> dict:
    for _, doc in all_docs():
        meta = doc.get("metadata") or {}
        if doc.get("kind") == kind and meta.get("name") == name and (namespace is None or meta.get("namespace") == namespace):
            return doc
    raise AssertionError(f"no {kind} {namespace}/{name} under k8s/")


def helm_values() -> dict:
    return yaml.safe_load(HELM_VALUES.read_text(encoding="utf-8"))


DOCS = all_docs()


# --------------------------------------------------------------------------- structure

def test_every_file_the_readme_names_exists_and_numbers_are_unique():
    text = README.read_text(encoding="utf-8")
    made_by_the_user = set(re.findall(r"cp k8s/\S+ k8s/([\w.-]+)", text))  # e.g. the filled-in secrets
    named = set(re.findall(r"k8s/([\w.-]+\.ya?ml)", text)) - made_by_the_user
    assert named and all((K8S / name).is_file() for name in named), sorted(n for n in named if not (K8S / n).is_file())
    # Numbered files are unique in their install position.
    prefixes = [p.name.split("-", 1)[0] for p in applied_files()]
    assert len(prefixes) == len(set(prefixes)), prefixes


def test_every_file_parses_and_has_kinds():
    assert DOCS, "no manifests found"
    for fname, doc in DOCS:
        assert isinstance(doc, dict), fname
        assert doc.get("apiVersion") and doc.get("kind"), f"{fname}: document without apiVersion/kind"
        assert (doc.get("metadata") or {}).get("name"), f"{fname}: {doc.get('kind')} without a name"


@pytest.mark.parametrize("fname,doc", DOCS, ids=[_doc_id(f, d) for f, d in DOCS])
def test_validates_against_kubernetes_schema(fname, doc):
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{_doc_id(fname, doc)} is not a valid Kubernetes {K8S_VERSION} object at {where}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"{_doc_id(fname, doc)}: no Kubernetes {K8S_VERSION} schema for {doc['apiVersion']} {doc['kind']}")


def test_namespaced_objects_name_a_defined_namespace():
    defined = {doc["metadata"]["name"] for _, doc in DOCS if doc["kind"] == "Namespace"}
    assert {WORKLOAD_NS, "mlflow"} <= defined
    for fname, doc in DOCS:
        if doc["kind"] in NAMESPACED_KINDS:
            ns = doc["metadata"].get("namespace")
            assert ns, f"{_doc_id(fname, doc)} has no explicit namespace"
            assert ns in defined, f"{_doc_id(fname, doc)} uses undefined namespace {ns}"


def test_numbered_files_keep_one_concern_each():
    # A quick guard against dumping unrelated objects into one file.
    for path in applied_files():
        kinds = {doc["kind"] for doc in _load_all(path)}
        assert len(kinds) <= 3, f"{path.name} mixes {sorted(kinds)}"


# --------------------------------------------------------------------------- credentials

def test_no_secret_objects_outside_the_example():
    for fname, doc in DOCS:
        if doc["kind"] == "Secret":
            assert Path(fname) == Path(SECRETS_EXAMPLE.name), f"{_doc_id(fname, doc)}: Secrets belong only in secrets.example.yaml"


def test_no_plaintext_credentials_in_manifests():
    for fname, doc in DOCS:
        if fname == SECRETS_EXAMPLE.name:
            continue
        ident = _doc_id(fname, doc)
        # Credential-named env vars only ever come from Secrets.
        for spec in pod_specs(doc):
            for c in containers(spec):
                for env in c.get("env") or []:
                    if CRED_RE.search(env["name"]):
                        assert "value" not in env, f"{ident}: env {env['name']} has a literal value"
                        assert "secretKeyRef" in (env.get("valueFrom") or {}), f"{ident}: env {env['name']} must use secretKeyRef"
                for src in c.get("envFrom") or []:
                    assert "configMapRef" not in src or not CRED_RE.search(src["configMapRef"]["name"]), ident
        # ConfigMaps hold no credential-named keys.
        if doc["kind"] == "ConfigMap":
            for key in (doc.get("data") or {}):
                assert not CRED_RE.search(key), f"{ident}: ConfigMap key {key} looks like a credential"
        # No user:password@ in any URI unless both parts are $(VAR) references.
        for text in walk_strings(doc):
            for user, password in URI_USERINFO_RE.findall(text):
                assert VAR_REF_RE.match(user) and VAR_REF_RE.match(password), f"{ident}: credentials in URI {text!r}"


def test_example_secrets_hold_only_placeholders():
    docs = _load_all(SECRETS_EXAMPLE)
    assert docs and all(d["kind"] == "Secret" for d in docs)
    non_secret_keys = {"POSTGRES_USER", "POSTGRES_DB", "MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"}
    for doc in docs:
        ident = _doc_id(SECRETS_EXAMPLE.name, doc)
        assert "data" not in doc, f"{ident}: use stringData placeholders, not base64 data"
        assert doc.get("stringData"), ident
        for key, value in doc["stringData"].items():
            if key in non_secret_keys:
                continue
            assert str(value).startswith("CHANGE_ME"), f"{ident}: {key} is not a CHANGE_ME placeholder"
    # Filled-in copies stay out of git.
    ignored = (K8S / ".gitignore").read_text(encoding="utf-8").split()
    assert "secrets.yaml" in ignored


def test_helm_values_hold_no_credentials():
    values = helm_values()
    for path, key, value in walk_items(values):
        if re.search(r"(password|secretkey|accesskey|clientsecret|token)$", key.replace("-", "").replace("_", "").lower()):
            assert value in (None, ""), f"flyte-binary-values.yaml: {'.'.join(map(str, path + (key,)))} must not hold a value"
    for text in walk_strings(values):
        assert not URI_USERINFO_RE.search(text), f"credentials in URI {text!r}"
    db = values["configuration"]["database"]
    assert db.get("passwordPath"), "database password must come from a mounted Secret file"
    s3 = values["configuration"]["storage"]["providerConfig"]["s3"]
    assert s3["authType"] == "iam", "accesskey auth would put keys in the values file"


def test_referenced_secrets_and_keys_are_templated():
    example = {(d["metadata"]["namespace"], d["metadata"]["name"]): set(d["stringData"]) for d in _load_all(SECRETS_EXAMPLE)}
    refs: list[tuple[str, str, str | None, str]] = []  # namespace, secret, key|None, where
    for fname, doc in DOCS:
        ns = doc["metadata"].get("namespace")
        for spec in pod_specs(doc):
            for c in containers(spec):
                for env in c.get("env") or []:
                    ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                    if ref:
                        refs.append((ns, ref["name"], ref["key"], _doc_id(fname, doc)))
                for src in c.get("envFrom") or []:
                    if "secretRef" in src:
                        refs.append((ns, src["secretRef"]["name"], None, _doc_id(fname, doc)))
            for vol in spec.get("volumes") or []:
                if "secret" in vol:
                    refs.append((ns, vol["secret"]["secretName"], None, _doc_id(fname, doc)))
    values = helm_values()
    refs.append(("flyte", values["deployment"]["extraEnvVarsSecret"], None, "flyte-binary-values.yaml"))
    for vol in values["deployment"]["extraVolumes"]:
        if "secret" in vol:
            refs.append(("flyte", vol["secret"]["secretName"], None, "flyte-binary-values.yaml"))
    assert refs
    for ns, name, key, where in refs:
        assert (ns, name) in example, f"{where} refers to Secret {ns}/{name}, which secrets.example.yaml does not define"
        if key is not None:
            assert key in example[(ns, name)], f"{where} refers to key {key} missing from Secret {ns}/{name}"


def test_referenced_configmaps_and_env_vars_exist():
    configmaps = {(d["metadata"]["namespace"], d["metadata"]["name"]): d.get("data") or {} for _, d in DOCS if d["kind"] == "ConfigMap"}
    for fname, doc in DOCS:
        ns = doc["metadata"].get("namespace")
        for spec in pod_specs(doc):
            for c in containers(spec):
                known: set[str] = set()
                for src in c.get("envFrom") or []:
                    if "configMapRef" in src:
                        key = (ns, src["configMapRef"]["name"])
                        assert key in configmaps, f"{_doc_id(fname, doc)} refers to missing ConfigMap {key}"
                        known |= set(configmaps[key])
                    if "secretRef" in src:
                        example = {d["metadata"]["name"]: d for d in _load_all(SECRETS_EXAMPLE)}
                        known |= set(example[src["secretRef"]["name"]]["stringData"])
                for env in c.get("env") or []:
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", env.get("value", "")):
                        assert ref in known, f"{_doc_id(fname, doc)}: env {env['name']} uses $({ref}) before it is defined"
                    known.add(env["name"])
                for arg in (c.get("command") or []) + (c.get("args") or []):
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                        assert ref in known, f"{_doc_id(fname, doc)}: argument uses undefined $({ref})"


# --------------------------------------------------------------------------- pod security

POD_DOCS = [(f, d) for f, d in DOCS if pod_specs(d)]


def test_there_are_pod_specs_to_check():
    kinds = {d["kind"] for _, d in POD_DOCS}
    assert {"Deployment", "StatefulSet", "PodTemplate"} <= kinds


@pytest.mark.parametrize("fname,doc", POD_DOCS, ids=[_doc_id(f, d) for f, d in POD_DOCS])
def test_pods_run_as_non_root(fname, doc):
    ident = _doc_id(fname, doc)
    for spec in pod_specs(doc):
        psc = spec.get("securityContext") or {}
        assert psc.get("runAsNonRoot") is True, f"{ident}: pod securityContext.runAsNonRoot must be true"
        # Numeric uid: images with a named USER cannot be verified otherwise.
        assert isinstance(psc.get("runAsUser"), int) and psc["runAsUser"] > 0, f"{ident}: set a non-zero runAsUser"
        assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", ident
        assert spec.get("automountServiceAccountToken") is False, f"{ident}: no service-account token needed"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), ident
        for vol in spec.get("volumes") or []:
            assert "hostPath" not in vol, f"{ident}: hostPath volume {vol['name']}"
        for c in containers(spec):
            csc = c.get("securityContext") or {}
            assert csc.get("runAsNonRoot", True) is True, f"{ident}/{c['name']}"
            assert csc.get("runAsUser", 1) != 0, f"{ident}/{c['name']} runs as root"
            assert csc.get("allowPrivilegeEscalation") is False, f"{ident}/{c['name']}: allowPrivilegeEscalation"
            assert not csc.get("privileged"), f"{ident}/{c['name']} is privileged"
            assert "ALL" in ((csc.get("capabilities") or {}).get("drop") or []), f"{ident}/{c['name']}: drop ALL capabilities"


@pytest.mark.parametrize("fname,doc", POD_DOCS, ids=[_doc_id(f, d) for f, d in POD_DOCS])
def test_every_container_sets_resources(fname, doc):
    for spec in pod_specs(doc):
        for c in containers(spec):
            res = c.get("resources") or {}
            ident = f"{_doc_id(fname, doc)}/{c['name']}"
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    assert resource in (res.get(kind) or {}), f"{ident}: resources.{kind}.{resource} missing"


def test_long_running_workloads_have_probes():
    for fname, doc in DOCS:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in pod_specs(doc)[0]["containers"]:
            assert c.get("readinessProbe"), f"{_doc_id(fname, doc)}/{c['name']}: readinessProbe"
            assert c.get("livenessProbe"), f"{_doc_id(fname, doc)}/{c['name']}: livenessProbe"


def test_images_are_pinned_to_a_tag():
    for fname, doc in POD_DOCS:
        for spec in pod_specs(doc):
            for c in containers(spec):
                image = c.get("image", "")
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                assert tag and tag != "latest", f"{_doc_id(fname, doc)}/{c['name']}: pin image {image!r} to a version tag"


def test_namespace_pod_security_labels():
    ns = {d["metadata"]["name"]: d["metadata"].get("labels") or {} for _, d in DOCS if d["kind"] == "Namespace"}
    assert ns["mlflow"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert ns[WORKLOAD_NS]["pod-security.kubernetes.io/enforce"] in ("baseline", "restricted")
    assert ns[WORKLOAD_NS]["pod-security.kubernetes.io/warn"] == "restricted"


# --------------------------------------------------------------------------- RBAC

def test_rbac_is_namespace_scoped_and_least_privilege():
    kinds = {d["kind"] for _, d in DOCS}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [(f, d) for f, d in DOCS if d["kind"] == "Role"]
    assert roles
    for fname, role in roles:
        for rule in role["rules"]:
            ident = _doc_id(fname, role)
            assert "*" not in rule.get("verbs", []) and "*" not in rule.get("resources", []), f"{ident}: wildcard"
            assert "*" not in rule.get("apiGroups", []), f"{ident}: wildcard apiGroup"
            assert "secrets" not in rule.get("resources", []), f"{ident} grants access to Secrets"
            assert not {"pods/exec", "pods/attach"} & set(rule.get("resources", [])), f"{ident} grants exec/attach"
    for fname, binding in ((f, d) for f, d in DOCS if d["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        find("Role", binding["roleRef"]["name"], binding["metadata"]["namespace"])


def test_service_accounts_mount_no_tokens():
    sas = [d for _, d in DOCS if d["kind"] == "ServiceAccount"]
    assert {"dapo-task", "mlflow-server", "mlflow-postgres"} <= {d["metadata"]["name"] for d in sas}
    for sa in sas:
        assert sa.get("automountServiceAccountToken") is False, sa["metadata"]["name"]
    for fname, doc in POD_DOCS:
        sa_name = pod_specs(doc)[0].get("serviceAccountName")
        if sa_name:
            find("ServiceAccount", sa_name, doc["metadata"]["namespace"])


# --------------------------------------------------------------------------- quota

def test_workload_namespace_has_quota_and_limit_range():
    quotas = [d for _, d in DOCS if d["kind"] == "ResourceQuota" and d["metadata"]["namespace"] == WORKLOAD_NS]
    hard: dict = {}
    for q in quotas:
        hard.update(q["spec"]["hard"])
    for key in ("requests.cpu", "requests.memory", "limits.memory", "requests.nvidia.com/gpu", "pods"):
        assert key in hard, f"ResourceQuota in {WORKLOAD_NS} lacks {key}"
    ranges = [d for _, d in DOCS if d["kind"] == "LimitRange" and d["metadata"]["namespace"] == WORKLOAD_NS]
    assert ranges
    container = [lim for r in ranges for lim in r["spec"]["limits"] if lim["type"] == "Container"]
    assert container and container[0]["default"].get("memory") and container[0]["defaultRequest"].get("cpu")


def _quantity(value) -> float:
    """A Kubernetes quantity (e.g. "2304", "500m", "18Ti", "64Gi") as a number."""
    value = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def _stage_requests(settings: dict, pods: int) -> dict[str, float]:
    requests = settings["requests"]
    return {
        "requests.cpu": pods * _quantity(requests.cpu), "requests.memory": pods * _quantity(requests.mem),
        "limits.memory": pods * _quantity(settings["limits"].mem), "requests.nvidia.com/gpu": pods * _quantity(requests.gpu or 0),
        "requests.ephemeral-storage": pods * _quantity(requests.ephemeral_storage),
    }


@pytest.mark.parametrize("stage", ["colocated_chunk", "policy_step", "rollout_round"])
def test_quota_admits_each_stage_of_paper_32b(stage):
    """The biggest stages of the paper's run, as the workflow shapes their pods in either
    execution mode, fit the namespace quota (with room for the dynamic workflows and small CPU pods)."""
    from tasks.common import colocated_settings, rollout_settings, trainer_settings

    config = DAPOConfig.paper_32b()
    needed = {
        "colocated_chunk": lambda: _stage_requests(colocated_settings(config), config.trainer_nnodes),
        "policy_step": lambda: _stage_requests(trainer_settings(config), config.trainer_nnodes),
        "rollout_round": lambda: _stage_requests(rollout_settings(config), config.rollout_shards),
    }[stage]()
    hard: dict = {}
    for _, doc in DOCS:
        if doc["kind"] == "ResourceQuota" and doc["metadata"]["namespace"] == WORKLOAD_NS:
            hard.update(doc["spec"]["hard"])
    for key, amount in needed.items():
        assert amount <= _quantity(hard[key]), f"{stage} of paper_32b needs {key}={amount:.4g}, quota {hard[key]}"
    assert needed["requests.nvidia.com/gpu"] == 128  # the whole 16 x 8 cluster in turn


def test_paper_32b_pods_request_disk_for_what_they_hold():
    """Every pod that holds weights or a checkpoint asks for that much local disk: the
    LimitRange default (10Gi) would have them evicted."""
    from tasks.common import DISK_MARGIN_GIB, bootstrap_settings, registry_settings, rollout_settings, trainer_settings

    config = DAPOConfig.paper_32b()
    gib = {name: _quantity(settings["requests"].ephemeral_storage) / 2**30 - DISK_MARGIN_GIB for name, settings in {
        "rollout": rollout_settings(config), "trainer": trainer_settings(config),
        "bootstrap": bootstrap_settings(config), "register": registry_settings(config)}.items()}
    weights_gib = 32.8e9 * 2 / 2**30  # bf16
    assert gib["rollout"] >= weights_gib and gib["register"] >= weights_gib
    assert gib["bootstrap"] >= 2 * weights_gib
    assert gib["trainer"] >= 8 * weights_gib  # the ZeRO checkpoint: 16 bytes a parameter
    assert max(gib.values()) + DISK_MARGIN_GIB <= _quantity(helm_values()["configuration"]["inline"]["task_resources"]["limits"]["ephemeralStorage"]) / 2**30


def test_helm_values_let_flyte_create_pytorch_jobs_and_echo_tasks():
    values = helm_values()
    rules = values["rbac"]["extraRules"]
    assert any("kubeflow.org" in r["apiGroups"] and "pytorchjobs" in r["resources"] and {"create", "watch", "delete"} <= set(r["verbs"])
               for r in rules)
    for plugins in (values["enabled_plugins"]["tasks"]["task-plugins"], values["configuration"]["inline"]["tasks"]["task-plugins"]):
        assert "echo" in plugins["enabled-plugins"] and plugins["default-for-task-types"]["echo"] == "echo"


# --------------------------------------------------------------------------- GPU pod templates

GPU_TEMPLATES = [d for _, d in DOCS if d["kind"] == "PodTemplate" and "gpu" in d["metadata"]["name"]]


def test_shared_gpu_template_mounts_the_rwx_claim_at_the_trainer_shared_dir():
    from dapo.config import DAPOConfig

    template = next(t for t in GPU_TEMPLATES if t["metadata"]["name"] == "dapo-gpu-shared")
    claims = [d for _, d in DOCS if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "dapo-shared"]
    assert claims and claims[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = template["template"]["spec"]
    volume = next(v["name"] for v in spec["volumes"] if (v.get("persistentVolumeClaim") or {}).get("claimName") == "dapo-shared")
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts[DAPOConfig.paper_32b().trainer_shared_dir] == volume


def test_gpu_templates_exist_in_workload_namespace():
    assert GPU_TEMPLATES, "no GPU PodTemplate"
    for t in GPU_TEMPLATES:
        assert t["metadata"]["namespace"] == WORKLOAD_NS


@pytest.mark.parametrize("template", GPU_TEMPLATES, ids=[t["metadata"]["name"] for t in GPU_TEMPLATES])
def test_gpu_template_tolerates_gpus_and_mounts_shm(template):
    spec = template["template"]["spec"]
    tolerations = spec.get("tolerations") or []
    assert any(
        t.get("key") == "nvidia.com/gpu"
        and t.get("operator", "Equal") in ("Exists", "Equal")
        and t.get("effect") in (None, "NoSchedule")
        for t in tolerations
    ), "GPU template must tolerate the nvidia.com/gpu taint"
    assert spec.get("nodeSelector"), "GPU template must select GPU nodes"
    shm_volumes = {v["name"] for v in spec.get("volumes") or [] if (v.get("emptyDir") or {}).get("medium") == "Memory"}
    assert shm_volumes, "GPU template needs a memory-backed emptyDir"
    default = [c for c in spec["containers"] if c["name"] == "default"]
    assert default, "Flyte merges the container named 'default' into every container it builds"
    mounts = {m["mountPath"]: m["name"] for m in default[0].get("volumeMounts") or []}
    assert mounts.get("/dev/shm") in shm_volumes, "/dev/shm must be the memory-backed volume"
    assert "nvidia.com/gpu" in default[0]["resources"]["limits"]


def test_pod_templates_match_the_image_user_and_point_at_mlflow():
    templates = [d for _, d in DOCS if d["kind"] == "PodTemplate"]
    assert {"dapo-default", "dapo-gpu"} <= {t["metadata"]["name"] for t in templates}
    for t in templates:
        spec = t["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == pins.RUNTIME_UID
        assert spec["securityContext"]["runAsGroup"] == pins.RUNTIME_UID
        default = next(c for c in spec["containers"] if c["name"] == "default")
        env = {e["name"]: e.get("value") for e in default.get("env") or []}
        assert env.get("MLFLOW_TRACKING_URI") == MLFLOW_URI
        # the pipeline's MLflow user, optional (a pod must start against a server without auth)
        assert {"name": "dapo-mlflow-auth", "optional": True} in [s["secretRef"] for s in default["envFrom"] if "secretRef" in s]
        assert spec["imagePullSecrets"] == [{"name": "dapo-registry"}]


# --------------------------------------------------------------------------- MLflow

def test_mlflow_server_uses_postgres_s3_serves_artifacts_and_authenticates():
    """The start script itself runs against a real server in tests/test_tracking.py."""
    dep = find("Deployment", "mlflow", "mlflow")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cmd = " ".join((c.get("command") or []) + (c.get("args") or []))
    assert "exec mlflow server --app-name=basic-auth" in cmd
    assert "default_permission = NO_PERMISSIONS" in cmd  # people read what they were granted (k8s/README.md)
    assert "--serve-artifacts" in cmd and "--artifacts-destination" in cmd and "--backend-store-uri" in cmd
    assert {s["secretRef"]["name"] for s in c["envFrom"] if "secretRef" in s} == {"mlflow-s3", "mlflow-auth"}
    env = {e["name"]: e for e in c["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"].startswith("postgresql://")
    cfg = find("ConfigMap", "mlflow-config", "mlflow")["data"]
    assert cfg["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    # The host name the pipeline uses must pass MLflow's host-header check.
    allowed = cfg["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert "mlflow.mlflow.svc.cluster.local:5000" in allowed
    assert not [host for host in allowed if "*" in host], "name the service's hosts, not whole address ranges"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_mlflow_service_matches_the_documented_uri():
    svc = find("Service", "mlflow", "mlflow")
    assert any(p["port"] == 5000 for p in svc["spec"]["ports"])
    dep = find("Deployment", "mlflow", "mlflow")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert MLFLOW_URI in README.read_text(encoding="utf-8")


def test_postgres_statefulset_has_storage():
    sts = find("StatefulSet", "mlflow-postgres", "mlflow")
    assert sts["spec"]["serviceName"] == "mlflow-postgres"
    find("Service", "mlflow-postgres", "mlflow")
    claims = sts["spec"]["volumeClaimTemplates"]
    assert claims and claims[0]["spec"]["resources"]["requests"]["storage"]
    mounts = {m["name"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert claims[0]["metadata"]["name"] in mounts


def test_network_policies_fence_mlflow_and_postgres():
    pols = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    deny = [p for p in pols.values() if p["spec"]["podSelector"] == {} and p["metadata"]["namespace"] == "mlflow"]
    assert deny and "Ingress" in deny[0]["spec"]["policyTypes"] and not deny[0]["spec"].get("ingress")

    def ingress_for(app: str) -> list[dict]:
        return [
            rule
            for p in pols.values()
            if p["metadata"]["namespace"] == "mlflow"
            and p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == app
            for rule in p["spec"].get("ingress") or []
        ]

    pg_rules = ingress_for("mlflow-postgres")
    assert pg_rules, "Postgres needs an ingress policy"
    for rule in pg_rules:
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "only pods in the mlflow namespace may reach Postgres"
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "mlflow"}
        assert [p["port"] for p in rule["ports"]] == [5432]

    srv_rules = ingress_for("mlflow")
    sources = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for rule in srv_rules
        for peer in rule["from"]
        if "namespaceSelector" in peer
    }
    assert WORKLOAD_NS in sources
    for rule in srv_rules:
        assert [p["port"] for p in rule["ports"]] == [5000]
        for peer in rule["from"]:
            assert "ipBlock" not in peer, "MLflow must not be open to arbitrary addresses"


# --------------------------------------------------------------------------- Helm values

def test_helm_values_sign_upload_urls_for_the_workstation_not_the_cluster():
    """Fast registration uploads from outside the cluster to a URL FlyteAdmin signs: signed
    for the in-cluster name, the workstation cannot resolve it (flyteorg/flyte#5663)."""
    values = helm_values()
    signing = values["configuration"]["inline"]["storage"]["signedUrl"]["stowConfigOverride"]["endpoint"]
    serving = values["configuration"]["storage"]["providerConfig"]["s3"]["endpoint"]
    assert signing.startswith("https://") and signing != serving and "svc.cluster.local" not in signing


def test_helm_values_enable_the_pytorch_plugin():
    values = helm_values()
    chart_plugins = values["enabled_plugins"]["tasks"]["task-plugins"]
    inline_plugins = values["configuration"]["inline"]["tasks"]["task-plugins"]
    for plugins in (chart_plugins, inline_plugins):
        assert "pytorch" in plugins["enabled-plugins"]
        assert "container" in plugins["enabled-plugins"]
        assert plugins["default-for-task-types"]["pytorch"] == "pytorch"
    assert chart_plugins == inline_plugins, "keep the two plugin lists identical"


def test_helm_values_gpu_and_namespace_settings():
    values = helm_values()
    inline = values["configuration"]["inline"]
    k8s = inline["plugins"]["k8s"]
    assert k8s["gpu-resource-name"] == "nvidia.com/gpu"
    assert "default-tolerations" in k8s
    gpu_tols = k8s["resource-tolerations"]["nvidia.com/gpu"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in gpu_tols)
    # Tasks run where the quota, pod templates and Secrets are.
    assert inline["namespace_mapping"]["template"] == WORKLOAD_NS
    find("PodTemplate", k8s["default-pod-template-name"], WORKLOAD_NS)
    assert values["configuration"]["storage"]["provider"] == "s3"
    assert values["configuration"]["database"]["dbname"]


# --------------------------------------------------------------------------- README

def test_readme_documents_install_order():
    text = README.read_text(encoding="utf-8")
    for path in applied_files():
        assert f"k8s/{path.name}" in text, f"README does not say when to apply {path.name}"
    for needle in (
        "helm repo add flyteorg",
        "flyteorg/flyte-binary",
        "-f k8s/flyte-binary-values.yaml",
        "training-operator",
        "secrets.example.yaml",
        "MLFLOW_TRACKING_URI=" + MLFLOW_URI,
    ):
        assert needle in text, needle
    # The README's apply order follows the file numbering.
    positions = [text.index(f"k8s/{p.name}") for p in applied_files()]
    assert positions == sorted(positions)


# --------------------------------------------------------------------------- optional: gang scheduling, RDMA

OPTIONAL = K8S / "optional"


def test_kueue_admits_paper_32bs_policy_step_as_one_gang():
    """Kueue's queues (a CRD: no Kubernetes schema to validate against) cover the resources
    the trainer asks for, hold all of paper_32b's biggest stage, and serve the dapo namespace."""
    from tasks.common import colocated_settings, trainer_settings

    docs = {d["kind"]: d for d in _load_all(OPTIONAL / "kueue-gang-scheduling.yaml")}
    assert {d["apiVersion"] for d in docs.values()} == {"kueue.x-k8s.io/v1beta1"}
    assert docs["LocalQueue"]["metadata"]["namespace"] == WORKLOAD_NS and docs["LocalQueue"]["spec"]["clusterQueue"] == "dapo"
    queue = docs["ClusterQueue"]["spec"]
    assert queue["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": WORKLOAD_NS}
    (group,) = queue["resourceGroups"]
    (flavor,) = group["flavors"]
    assert flavor["name"] == docs["ResourceFlavor"]["metadata"]["name"]
    quota = {r["name"]: _quantity(r["nominalQuota"]) for r in flavor["resources"]}
    config = DAPOConfig.paper_32b()
    for settings in (trainer_settings(config), colocated_settings(config)):
        needed = _stage_requests(settings, config.trainer_nnodes)
        assert set(group["coveredResources"]) == set(quota) == {"cpu", "memory", "nvidia.com/gpu", "ephemeral-storage"}
        assert needed["requests.cpu"] <= quota["cpu"] and needed["requests.memory"] <= quota["memory"]
        assert needed["requests.nvidia.com/gpu"] <= quota["nvidia.com/gpu"]
        assert needed["requests.ephemeral-storage"] <= quota["ephemeral-storage"]
    assert "--labels kueue.x-k8s.io/queue-name=dapo" in (OPTIONAL / "kueue-gang-scheduling.yaml").read_text()


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge for what the RDMA patch touches: maps merge, lists of
    named items merge by name, other lists are appended to."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list):
        if all(isinstance(x, dict) and "name" in x for x in base + patch):
            merged = {x["name"]: x for x in base}
            for item in patch:
                merged[item["name"]] = strategic_merge(merged[item["name"]], item) if item["name"] in merged else item
            return list(merged.values())
        return base + [x for x in patch if x not in base]
    return patch


def test_the_rdma_patch_gives_the_trainer_template_rdma_and_ipc_lock_and_stays_valid():
    template = find("PodTemplate", "dapo-gpu-shared", WORKLOAD_NS)
    (patch,) = _load_all(OPTIONAL / "rdma-trainer-patch.yaml")
    patched = strategic_merge(template, patch)
    kubernetes_validate.validate(patched, K8S_VERSION, strict=True)
    (default,) = patched["template"]["spec"]["containers"]
    assert default["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert default["resources"]["limits"]["nvidia.com/gpu"] == "1"  # the base template's stay
    assert default["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    env = {e["name"]: e.get("value") for e in default["env"]}
    assert env["NCCL_IB_DISABLE"] == "0" and env["MLFLOW_TRACKING_URI"] == MLFLOW_URI
    # baseline Pod Security refuses IPC_LOCK: the file says so
    assert "pod-security.kubernetes.io/enforce=privileged" in (OPTIONAL / "rdma-trainer-patch.yaml").read_text()
