"""One-step-off-policy execution of a colocated chunk (off_policy_steps=1): a trainer process
and a rollout process, side by side.

Step t's batch is sampled from the weights before step t-1's update (step 0's and step 1's
from the starting weights), so the rollout of step t+1 runs while step t trains (verl's
one-step-off, NeMo-RL's): a step takes about max(rollout, update) plus the weight
broadcast instead of their sum. The update corrects for the lag with the config's
rollout_correction (dapo.algorithm.rollout_correction): pi_old is the trainer's weights at the step,
pi_rollout the lagging weights that sampled.

The trainer's ranks (one process, or trainer_nproc_per_node on one node under torch elastic)
run the colocated steps' update, records and checkpoints (dapo.execution.colocated); the rollout
process (python -m dapo.execution.overlap, started by rank 0, on the GPUs after the ranks') holds one
engine of tensor_parallel_size GPUs. They share out_root:
- the rollout process writes each step's batch as out_root/batches/<step>.arrow (whole or
  not at all), with its sampling state and the policy version that sampled it;
- after each update the trainer broadcasts its weights (one flat tensor per dtype: gloo on
  CPU, NCCL on GPUs) in a process group of the two, apart from any default group that the
  trainer or vLLM sets up in its own process.

Nothing is lost or replayed when the chunk is killed: the trainer writes checkpoint t+1
only once batch t+1 (sampled from the weights of checkpoint t) is on disk, so a resume from
checkpoint k finds batch k and samples batch k+1 from checkpoint k's weights, as the
uninterrupted run did. The batch of the step after the chunk is sampled during its last
step and returned: the next chunk's first batch.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import logging
import operator
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.ipc

from dapo.algorithm.sampling import SamplingState
from dapo.config import StepConfig
from dapo.execution.colocated import (
    ColocatedResult,
    SampledBatch,
    completed_steps,
    finish_step,
    stops_the_run,
    update_on_batch,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BATCHES = "batches"
"""out_root/batches/<step>.arrow: the batch each step trains on, as the rollout process sampled it."""
POLL_SECONDS = 0.02
"""How often the trainer looks for the batch it waits for (and whether the rollout process still runs)."""
GROUP_TIMEOUT = datetime.timedelta(hours=2)
"""The longest a broadcast waits for the other process: a rollout longer than this is a hung one."""


def batch_path(out_root: Path, step: int) -> Path:
    return Path(out_root) / BATCHES / f"{step}.arrow"


def write_batch(out_root: Path, step: int, sampled: SampledBatch) -> None:
    """out_root/batches/<step>.arrow, written whole or not at all."""
    path = batch_path(out_root, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        **(sampled.batch.schema.metadata or {}),
        b"dapo.sampling_state": sampled.state.to_json().encode(),
        b"dapo.policy_version": str(sampled.policy_version).encode(),
    }
    table = sampled.batch.replace_schema_metadata(metadata)
    scratch = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(scratch), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(scratch, path)


def read_batch(out_root: Path, step: int) -> SampledBatch | None:
    """Step's batch from out_root, None when it is not there (yet)."""
    path = batch_path(out_root, step)
    if not path.exists():
        return None
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    metadata = dict(table.schema.metadata)
    state = SamplingState.from_json(metadata.pop(b"dapo.sampling_state").decode())
    version = int(metadata.pop(b"dapo.policy_version"))
    return SampledBatch(table.replace_schema_metadata(metadata), state, version)


def discard_batches(out_root: Path, keep: Callable[[int], bool]) -> None:
    for path in (Path(out_root) / BATCHES).glob("*.arrow"):
        if not keep(int(path.stem)):
            path.unlink(missing_ok=True)


class WeightBroadcast:
    """The trainer's weights to the rollout process, in a process group of the two (rank 0 the
    trainer): one flat tensor per dtype a broadcast; the names and shapes go once through
    the store. NCCL where the processes have GPUs, gloo on CPU."""

    def __init__(self, store, rank: int, device: str):
        import torch.distributed as dist

        # Any: torch's stubs lack the timeout argument and broadcast() of both classes
        group_type: Any = dist.ProcessGroupNCCL if device.startswith("cuda") else dist.ProcessGroupGloo
        self.group = group_type(store, rank, 2, GROUP_TIMEOUT)
        self.store, self.rank, self.device = store, rank, device
        self.layout: list[tuple[str, list[int], str]] | None = None

    def _broadcast(self, tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.group.broadcast([tensor], options).wait()

    def send(self, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        named = list(named_weights)
        if self.layout is None:
            self.layout = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]
            self.store.set("layout", json.dumps(self.layout))
        for dtype in dict.fromkeys(t.dtype for _, t in named):
            self._broadcast(torch.cat([t.reshape(-1) for _, t in named if t.dtype == dtype]).to(self.device))

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        import torch

        if self.layout is None:
            self.layout = [tuple(entry) for entry in json.loads(self.store.get("layout"))]
        received = []
        for dtype in dict.fromkeys(d for _, _, d in self.layout):
            entries = [(name, shape) for name, shape, d in self.layout if d == dtype]
            flat = torch.empty(
                sum(torch.Size(shape).numel() for _, shape in entries), dtype=getattr(torch, dtype), device=self.device
            )
            self._broadcast(flat)
            for (name, shape), part in zip(entries, flat.split([torch.Size(s).numel() for _, s in entries])):
                received.append((name, part.view(shape)))
        return received


def process_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
"""What torchrun sets for the trainer's ranks: the rollout process is none of them (vLLM would
take them for its own data-parallel ranks)."""


class RolloutProcess:
    """The rollout process of an overlapped chunk, seen from the trainer's ranks: rank 0 starts
    it and sends it the weights; every rank reads the batches it writes."""

    def __init__(
        self, config: StepConfig, policy_dir: str, data_dir: str, out_root: Path, first: int, last: int, main: bool
    ):
        """On the main rank, starts `python -m dapo.execution.overlap`, which samples batches first..last
        (those not on disk yet), the first two from policy_dir's weights, each later one b
        from the weights the trainer broadcasts after step b - 2, on the GPUs after the
        trainer's ranks' (the chunk's pod asks for tensor_parallel_size more). It dies with
        the main rank's process (PR_SET_PDEATHSIG)."""
        self.out_root, self.process, self.weights = Path(out_root), None, None
        if not main:
            return
        import torch
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        spec = {
            "config": config.to_json(),
            "policy_dir": policy_dir,
            "data_dir": data_dir,
            "out_root": str(out_root),
            "first": first,
            "last": last,
            "port": self.store.port,
        }
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        trainer_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if torch.cuda.device_count() > trainer_gpus:
            visible = os.environ.get(
                "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count())))
            ).split(",")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[trainer_gpus : trainer_gpus + config.tensor_parallel_size])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dapo.execution.overlap", json.dumps(spec)], env=env, preexec_fn=die_with_parent
        )
        try:
            while not self.store.check(
                ["ready"]
            ):  # its imports done; a process that dies first is reported, not waited for
                self.raise_if_exited("starting")
                time.sleep(POLL_SECONDS)
            self.weights = WeightBroadcast(self.store, 0, process_device())
        except BaseException:
            self.stop()
            raise

    def raise_if_exited(self, doing: str) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"the rollout process exited ({describe_exit(self.process.returncode)}) {doing}; its log is above"
            )

    def wait_for(self, step: int) -> SampledBatch:
        """Step's batch, once the rollout process has written it. Another rank than the main
        one cannot see the process: if it dies, the main rank raises and the job ends."""
        while (sampled := read_batch(self.out_root, step)) is None:
            self.raise_if_exited(f"before writing step {step}'s batch")
            time.sleep(POLL_SECONDS)
        return sampled

    def send_weights(self, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The trainer's weights to the rollout process: every rank reads them (under ZeRO-3 a
        collective gather), the main rank sends them."""
        if self.weights is None:
            for _ in named_weights:
                pass
            return
        self.weights.send(named_weights)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the trainer's process dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_overlapped(
    config: StepConfig,
    policy_dir: str,
    data_dir: str,
    first_step: int,
    n_steps: int,
    out_root: str | Path,
    checkpoint_every: int = 1,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    first_batch: SampledBatch | None = None,
) -> ColocatedResult:
    """Steps [first_step, first_step + n_steps) one step off policy, as dapo.execution.colocated.run_colocated
    runs them on policy (records, checkpoints, resume, early stop alike), from policy_dir's
    checkpoint; first_batch: the step's batch that the chunk before sampled (its
    result.next_batch). Without one, a chunk that does not start the run samples its first
    step on policy (off_policy/staleness 0). result.next_batch is the batch of the step
    after the chunk.

    Per step, besides run_colocated's metrics: off_policy/staleness (updates between the
    weights that sampled the batch and those it trains), off_policy/wait_seconds (the
    trainer waiting for batches: the next step's after its update, and at the chunk's
    start its own; above 0 where the rollout is the slower side), sync/seconds (the
    weights' broadcast)."""
    from dapo.engines.trainer import make_trainer

    out_root = Path(out_root)
    end = first_step + n_steps
    result = completed_steps(out_root, first_step, n_steps)
    done = len(result.step_metrics)
    if done == n_steps or stops_the_run(config, result.step_metrics):
        result.next_batch = read_batch(out_root, first_step + done)
        return result
    start = first_step + done
    if done:
        policy_dir = result.checkpoint_dir
        logger.info("resuming after step %d from %s (%d of %d steps were done)", start - 1, policy_dir, done, n_steps)
    trainer = make_trainer(config, policy_dir)  # first: under a launcher it sets up the ranks' process group
    if trainer.is_main:
        if not done and first_batch is not None and read_batch(out_root, start) is None:
            write_batch(out_root, start, first_batch)
        # Later batches on disk came from weights that a killed run computed after its last checkpoint.
        discard_batches(out_root, keep=lambda step: start <= step <= start + 1)
        if start > 0 and read_batch(out_root, start) is None:
            logger.warning(
                "step %d: no batch sampled one step off for it; the rollout process samples it on policy", start
            )
    trainer.barrier()  # no rank reads a batch the main rank is about to discard
    rollout = None
    try:
        rollout = RolloutProcess(config, policy_dir, data_dir, out_root, start, end, trainer.is_main)
        waited = time.perf_counter()
        sampled = rollout.wait_for(start)
        wait_seconds = time.perf_counter() - waited
        for step in range(start, end):
            started = time.perf_counter()
            metrics, _ = update_on_batch(config, trainer, sampled.batch, sampled.state, step, out_root)
            metrics["policy_step/seconds"] = time.perf_counter() - started
            metrics["off_policy/staleness"] = float(step - sampled.policy_version)
            # The next step's batch (after the chunk's last step, the next chunk's first) is on disk before
            # checkpoint step + 1, and the rollout process is done with it before it takes the weights.
            waited = time.perf_counter()
            sampled = rollout.wait_for(step + 1)
            metrics["off_policy/wait_seconds"] = wait_seconds + time.perf_counter() - waited
            wait_seconds = 0.0
            if step + 2 <= end:  # the weights batch step + 2 is sampled from
                synced = time.perf_counter()
                rollout.send_weights(trainer.named_weights())
                metrics["sync/seconds"] = time.perf_counter() - synced
            finished = finish_step(
                config, trainer, out_root, result, first_step, n_steps, step, metrics, checkpoint_every, on_step
            )
            if finished.checkpointed and trainer.is_main:  # a resume needs the batches from the checkpoint's step on
                discard_batches(out_root, keep=functools.partial(operator.lt, step))  # kept > step
            if finished.stop:
                break
        result.next_batch = sampled
    finally:
        if rollout is not None:
            rollout.stop()
        trainer.close()
    return result


def sample_batches(
    config: StepConfig, policy_dir: str, data_dir: str, out_root: Path, first: int, last: int, weights
) -> None:
    """The rollout process's work: batches first..last into out_root (skipping those there),
    first and first + 1 from policy_dir's weights (version first), then each batch b from
    the weights the trainer broadcasts after step b - 2 (version b - 1)."""
    from dapo.execution.stages.generation import policy_engine, sample_batch

    engine = policy_engine(config, policy_dir)  # not colocated: the engine has its GPUs to itself
    version = first
    for step in range(first, last + 1):
        if step >= first + 2:
            engine.load_weights_from_tensors(weights.receive())
            version = step - 1
        if read_batch(out_root, step) is None:
            batch, state = sample_batch(config, policy_dir, data_dir, step, engine=engine)
            write_batch(out_root, step, SampledBatch(batch, state, version))


def rollout_main(spec_json: str) -> None:
    """The rollout process (RolloutProcess starts it)."""
    import torch.distributed as dist

    spec = json.loads(spec_json)
    values = json.loads(spec["config"])
    config = StepConfig(**{f.name: values[f.name] for f in fields(StepConfig)})
    store = dist.TCPStore("127.0.0.1", spec["port"], 2, False, timeout=GROUP_TIMEOUT)
    store.set("ready", "1")
    weights = WeightBroadcast(store, 1, process_device())
    sample_batches(
        config, spec["policy_dir"], spec["data_dir"], Path(spec["out_root"]), spec["first"], spec["last"], weights
    )


if __name__ == "__main__":
    from dapo.logs import configure_logging

    configure_logging()
    rollout_main(sys.argv[1])
