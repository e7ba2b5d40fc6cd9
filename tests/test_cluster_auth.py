"""Nobody runs code on the cluster without logging in (k8s/README.md, "Logging in").

Offline: flyte-binary's values use only keys of the chart version k8s/README.md installs
(tests/fixtures holds that version's key list) and turn authentication on with its
secrets in a Secret; the workstation's and CI's flytekit configs parse; and `pyflyte`,
against a loopback stand-in for FlyteAdmin's auth endpoints (tests/flyte_auth_stub.py),
sends the bearer token CI's client gets and fails clearly without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flytekit.configuration import AuthType, PlatformConfig

import flyte_auth_stub
from servers import free_port, serve, stop

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
VALUES = yaml.safe_load((K8S / "flyte-binary-values.yaml").read_text())
CHART_VERSION = "v1.16.6"
CHART_KEYS = ROOT / "tests" / "fixtures" / f"flyte_binary_{CHART_VERSION}_values_keys.txt"
WORKSTATION_CONFIG = K8S / "flytekit" / "workstation.yaml"
CI_CONFIG = K8S / "flytekit" / "ci.yaml"


def chart_keys() -> dict[str, str]:
    """key -> type, a list item's `[0]` dropped (the key then names the list)."""
    keys = {}
    for line in CHART_KEYS.read_text().splitlines():
        if line and not line.startswith("#"):
            key, kind = line.split()
            if key.endswith("[0]"):
                key, kind = key[:-3], "list"
            keys[key] = kind
    return keys


def leaves(node, path: str = ""):
    """(dotted path, value) of every value in a values tree, lists and empty maps as values."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path, node


PYTHON_TYPE = {"bool": bool, "int": int, "string": str, "list": list, "object": dict}


def test_the_helm_values_use_only_keys_of_the_chart_version_installed():
    assert f"flyteorg/flyte-binary --version {CHART_VERSION}" in (K8S / "README.md").read_text()
    keys = chart_keys()
    assert keys["configuration.auth.clientSecretsExternalSecretRef"] == "string"
    for path, value in leaves(VALUES):
        prefixes = [".".join(path.split(".")[:n]) for n in range(1, path.count(".") + 2)]
        known = [p for p in prefixes if p in keys]
        assert known, f"flyte-binary-values.yaml: {path} is not a value of flyte-binary {CHART_VERSION}"
        # a key the chart types as a map or list takes anything beneath it (the inline config)
        deepest = known[-1]
        if deepest == path:
            assert isinstance(value, PYTHON_TYPE[keys[path]]), f"{path}: the chart takes a {keys[path]}, not {value!r}"
        else:
            assert keys[deepest] in ("object", "list"), f"{path}: {deepest} is a {keys[deepest]}, it has no {path}"


def test_flyte_binary_requires_a_login_through_oidc_with_its_secrets_in_a_secret():
    auth = VALUES["configuration"]["auth"]
    assert auth["enabled"] is True
    assert auth["enableAuthServer"] is True  # Flyte's own server issues the tokens; people log in at the IdP
    assert auth["oidc"]["baseUrl"].startswith("https://") and auth["oidc"]["clientId"]
    # no secret, and no secret's hash, in the file: the Secret and the install command carry them
    assert "clientSecret" not in auth["oidc"] and not {"clientSecret", "clientSecretHash"} & set(auth["internal"])
    secret = next(doc for doc in yaml.safe_load_all((K8S / "secrets.example.yaml").read_text())
                  if doc and doc["metadata"]["name"] == auth["clientSecretsExternalSecretRef"])
    assert secret["metadata"]["namespace"] == "flyte" and set(secret["stringData"]) == {"client_secret", "oidc_client_secret"}
    uris = auth["authorizedUris"]
    assert uris[0].startswith("https://"), "the external address first"
    assert any("flyte-binary-grpc.flyte.svc.cluster.local:8089" in uri for uri in uris)
    assert auth["flyteClient"]["redirectUri"].startswith("http://localhost:")
    ci_client = VALUES["configuration"]["inline"]["auth"]["appAuth"]["selfAuthServer"]["staticClients"]["dapo-ci"]
    assert ci_client["grant_types"] == ["client_credentials"] and "client_secret" not in ci_client
    install = (K8S / "README.md").read_text()
    for value in ("configuration.auth.internal.clientSecretHash=",
                  "configuration.inline.auth.appAuth.selfAuthServer.staticClients.dapo-ci.client_secret="):
        assert f"--set-string {value}" in install, f"k8s/README.md's helm command does not set {value}"


def test_the_workstation_logs_in_with_pkce_and_ci_with_its_client_secret(monkeypatch):
    workstation = PlatformConfig.auto(str(WORKSTATION_CONFIG))
    assert AuthType(workstation.auth_mode) is AuthType.PKCE and workstation.insecure is False
    assert workstation.endpoint == "flyte.example.com"
    monkeypatch.setenv("DAPO_CI_FLYTE_CLIENT_SECRET", "from-the-ci-secret-store")
    ci = PlatformConfig.auto(str(CI_CONFIG))
    assert AuthType(ci.auth_mode) is AuthType.CLIENTSECRET and ci.insecure is False
    assert (ci.client_id, ci.client_credentials_secret, ci.scopes) == ("dapo-ci", "from-the-ci-secret-store", ["all"])
    assert set(yaml.safe_load(CI_CONFIG.read_text())["admin"]) & {"clientSecret", "clientSecretLocation"} == set()


def loopback_ci_config(tmp_path: Path, port: int) -> Path:
    """k8s/flytekit/ci.yaml pointed at the loopback stand-in (plain gRPC on loopback)."""
    config = yaml.safe_load(CI_CONFIG.read_text())
    config["admin"].update(endpoint=f"dns:///127.0.0.1:{port}", insecure=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def flyte_admin_with_auth(tmp_path):
    grpc_port, token_port, log = free_port(), free_port(), tmp_path / "calls.jsonl"
    server = serve([sys.executable, str(Path(flyte_auth_stub.__file__)), str(grpc_port), str(token_port), str(log)],
                   grpc_port, tmp_path / "stub.log", dict(os.environ))
    yield grpc_port, log
    stop(server)


def pyflyte_info(config: Path, secret: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "DAPO_CI_FLYTE_CLIENT_SECRET"}
    env["HOME"] = str(config.parent)
    if secret is not None:
        env["DAPO_CI_FLYTE_CLIENT_SECRET"] = secret
    return subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "--config", str(config), "info"],
                          env=env, capture_output=True, text=True, timeout=120)


def presented_headers(log: Path) -> list:
    return [json.loads(line)["authorization"] for line in log.read_text().splitlines()] if log.exists() else []


def test_pyflyte_sends_the_bearer_token_of_ci_and_fails_clearly_without_one(tmp_path, flyte_admin_with_auth):
    port, log = flyte_admin_with_auth
    config = loopback_ci_config(tmp_path, port)

    ok = pyflyte_info(config, flyte_auth_stub.CLIENT_SECRET)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"Flyte Backend Version: {flyte_auth_stub.BACKEND_VERSION}" in ok.stdout
    assert presented_headers(log)[-1] == f"Bearer {flyte_auth_stub.TOKEN}"

    log.unlink()
    refused = pyflyte_info(config, "a-wrong-secret")
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and flyte_auth_stub.BACKEND_VERSION not in refused.stdout
    assert "Status Code (401) received from IDP" in output and "invalid_client" in output, output[-3000:]
    assert f"Bearer {flyte_auth_stub.TOKEN}" not in presented_headers(log)

    unset = pyflyte_info(config, None)
    assert unset.returncode != 0 and "Client ID and Client SECRET both are required" in unset.stdout + unset.stderr
