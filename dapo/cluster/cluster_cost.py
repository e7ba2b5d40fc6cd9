"""What one DAPO step costs on a cluster beyond its compute, per execution mode: a model.

No GPU or cluster has been available to us, so this is arithmetic, not a measurement.
Its inputs are our own measured components (bytes per parameter of the weights and of
the whole DeepSpeed checkpoint, DAPOConfig; the checkpoint save rate and the in-place
reload vs engine start ratio, benchmarks/RESULTS.md section 4) and public figures, each
named below with its source. Two execution modes:

- per_stage: every step is a chain of fresh pods. Each rollout pod
  downloads the bf16 weights and starts vLLM; the policy step's pods each download the
  whole checkpoint (weights + optimizer state), start DeepSpeed, update once, save, and
  rank 0's pod uploads the new checkpoint as the task's output.
- colocated (dapo.execution.colocated): steps_per_chunk steps inside one GPU task (the trainer's
  ranks, each also in a vLLM engine) with vLLM and the trainer resident, the weights
  synced in memory every step; the checkpoint download, the engine starts and the
  upload happen once a chunk, and each node saves its share of a record checkpoint every
  colocated_checkpoint_every steps (on trainer_shared_dir, not through the store).

Pods that run at the same time download at the same time, each at one client's
bandwidth (no limit on the store's side is modelled). Left out in both modes: pod
scheduling and image pulls, Flyte's own task overhead, validation (a separate node in
both modes), and any dynamic-sampling round past the first (per_stage pays each extra
round's downloads and engine starts again, colocated nothing). So per_stage's figures
are a lower bound.

It prices the run budget (dapo.cluster.run_budget) and benchmarks/cluster_cost.py prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dapo.config import DAPOConfig

MIB = 2**20
MODES = ("per_stage", "colocated")

# Bytes a parameter in bf16 training, as DAPOConfig sizes the pods' disks: weights 2; the
# whole ZeRO checkpoint 16 = weights twice + fp32 master weights + two fp32 Adam moments,
# the layout measured in RESULTS.md section 4 (5.00x the weights in fp32).
WEIGHT_BYTES_PER_PARAM = DAPOConfig(model_size_billions=1, dtype="bfloat16").weights_bytes / 1e9
CHECKPOINT_BYTES_PER_PARAM = DAPOConfig(model_size_billions=1, dtype="bfloat16").checkpoint_bytes / 1e9

GPUS_PER_NODE = 8  # the paper's nodes (DESIGN.md)
# One whole DAPO step of verl's 32B recipe (Qwen2.5-32B, 32.8B params) on 16 x 8 GPUs: 230
# steps in 5 days (volcengine/verl#795). verl keeps vLLM and the trainer resident (no
# restarts), so this is the step's compute.
VERL_STEP_S = 5 * 24 * 3600 / 230
VERL_GPUS = 16 * GPUS_PER_NODE
VERL_BILLIONS = 32.8
# vLLM engine start of a large tensor-parallel model (vllm-project/vllm#19824): weights from
# page cache ~10 s, torch.compile ~70 s, CUDA-graph capture ~60 s, plus the P2P check ~60 s
# with tensor parallelism; ~1 min with a reused compile cache (vllm#20264).
VLLM_COLD_START_S = 10 + 70 + 60
VLLM_P2P_CHECK_S = 60
VLLM_CACHED_START_S = 60
# Object store to one client: fsspec/s3fs (what flytekit uses) ~120 MiB/s, aws-cli CRT
# ~700 MiB/s (ray-project/ray#38695); FlyteFile is 10x slower than s5cmd (flyteorg/flyte#6455),
# so a FlyteDirectory sits at the slow end.
SLOW_CLIENT_MIB_S = 120
FAST_CLIENT_MIB_S = 700
# DeepSpeed: loading and starting a 32B model with HF ~10 min (deepspeedai/DeepSpeed#7369);
# scaled by parameters for other sizes.
DEEPSPEED_START_S = 10 * 60
DEEPSPEED_START_BILLIONS = 32
# In-memory weight sync inside one task: NeMo-RL's NCCL reshard of a 30B model, 0.5 s
# (NVIDIA-NeMo/RL#2413); scaled by parameters.
NCCL_SYNC_S = 0.5
NCCL_SYNC_BILLIONS = 30
# The update's share of a synchronous step: rollout is ~70% (verl docs/advance/one_step_off.md).
UPDATE_SHARE = 0.3
# Measured here (benchmarks/RESULTS.md section 4, benchmarks/weights_handoff.py, 146M params):
# a whole checkpoint's save to local disk, and vLLM's in-place weight reload against its start.
MEASURED_HANDOFF = {
    "whole checkpoint MB": 2910.2,
    "save s": 10.48,
    "vLLM in-place reload s": 0.299,
    "vLLM start s": 1.9,
}


@dataclass(frozen=True)
class Model:
    """A policy size and the cluster slice it runs on: nodes of gpus_per_node GPUs,
    one vLLM engine per tensor_parallel GPUs, rollout and training taking turns on them."""

    name: str
    billions: float
    nodes: int
    tensor_parallel: int
    gpus_per_node: int = GPUS_PER_NODE
    weight_bytes_per_param: float = WEIGHT_BYTES_PER_PARAM
    checkpoint_bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM

    @classmethod
    def of(cls, config: DAPOConfig) -> Model:
        """The policy and cluster slice of a config: its trainer's nodes and GPUs, its vLLM
        engines, its training dtype's bytes."""
        params = config.model_size_billions * 1e9
        return cls(
            f"{config.model_size_billions:g}B",
            config.model_size_billions,
            config.trainer_nnodes,
            config.tensor_parallel_size,
            config.trainer_nproc_per_node,
            config.weights_bytes / params,
            config.checkpoint_bytes / params,
        )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def engines(self) -> int:
        """vLLM engines: rollout pods per round in per_stage, resident engines in colocated."""
        return self.gpus // self.tensor_parallel

    @property
    def weights_bytes(self) -> float:
        return self.billions * 1e9 * self.weight_bytes_per_param

    @property
    def checkpoint_bytes(self) -> float:
        return self.billions * 1e9 * self.checkpoint_bytes_per_param


@dataclass(frozen=True)
class Scenario:
    """One end of the cited figures' ranges, with our measured rates."""

    name: str
    client_mib_s: float
    """Object store to one client."""
    vllm_start_s: float
    """One engine start, without the P2P check."""
    p2p_check_s: float
    """Added to an engine start with tensor parallelism."""
    save_bytes_s: float
    """Checkpoint save to disk by one writer (measured locally)."""
    sync_share_of_start: float
    """Colocated's per-step weight sync is at least NeMo-RL's NCCL figure, and at least
    this fraction of an engine start (0: NCCL's figure alone)."""


@dataclass(frozen=True)
class StepCost:
    """One step's restarts and copies, averaged over its chunk, against its compute."""

    vllm_starts: float
    deepspeed_starts: float
    bytes_moved: float
    """Through the object store, all pods together."""
    checkpoint_writes: float
    overhead_s: float
    """Wall-clock seconds on the step's critical path."""
    compute_s: float

    @property
    def share(self) -> float:
        """The overhead's share of the step's wall time."""
        return self.overhead_s / (self.overhead_s + self.compute_s)


def scenarios(handoff: dict[str, float] = MEASURED_HANDOFF) -> tuple[Scenario, Scenario]:
    """The low and high ends of the overhead: fast client, cached compile, NCCL-speed
    sync; slow client, cold compile, a sync as slow as our local in-place reload relative
    to an engine start."""
    save_bytes_s = handoff["whole checkpoint MB"] * 1e6 / handoff["save s"]
    reload_share = handoff["vLLM in-place reload s"] / handoff["vLLM start s"]
    low = Scenario("low", FAST_CLIENT_MIB_S, VLLM_CACHED_START_S, 0.0, save_bytes_s, 0.0)
    high = Scenario("high", SLOW_CLIENT_MIB_S, VLLM_COLD_START_S, VLLM_P2P_CHECK_S, save_bytes_s, reload_share)
    return low, high


def compute_s(model: Model) -> float:
    """The step's compute: verl's 32B step scaled by parameters per GPU (same batch and lengths)."""
    return VERL_STEP_S * (model.billions / VERL_BILLIONS) * (VERL_GPUS / model.gpus)


def transfer_s(nbytes: float, scenario: Scenario) -> float:
    return nbytes / (scenario.client_mib_s * MIB)


def vllm_start_s(model: Model, scenario: Scenario) -> float:
    return scenario.vllm_start_s + (scenario.p2p_check_s if model.tensor_parallel > 1 else 0.0)


def sync_s(model: Model, scenario: Scenario) -> float:
    """Colocated: the new weights from the trainer into vLLM in memory, once a step."""
    return max(
        NCCL_SYNC_S * model.billions / NCCL_SYNC_BILLIONS, scenario.sync_share_of_start * vllm_start_s(model, scenario)
    )


def trainer_restart(model: Model, scenario: Scenario) -> tuple[float, float]:
    """(bytes through the store, seconds) of one trainer start and end: each node downloads
    the whole checkpoint (policy_step: one download per node, all nodes at once), DeepSpeed
    starts, each node saves its share, rank 0's pod uploads the checkpoint (the task's output)."""
    ckpt = model.checkpoint_bytes
    seconds = transfer_s(ckpt, scenario) + DEEPSPEED_START_S * model.billions / DEEPSPEED_START_BILLIONS
    seconds += ckpt / model.nodes / scenario.save_bytes_s + transfer_s(ckpt, scenario)
    return (model.nodes + 1) * ckpt, seconds


def step_cost(model: Model, mode: str, steps_per_chunk: int, scenario: Scenario, checkpoint_every: int = 5) -> StepCost:
    """One step's cost in mode; per_stage restarts every step whatever steps_per_chunk.
    Colocated saves a checkpoint every checkpoint_every steps and after the chunk's last."""
    if steps_per_chunk < 1:
        raise ValueError(f"steps_per_chunk must be >= 1, got {steps_per_chunk}")
    trainer_bytes, trainer_s = trainer_restart(model, scenario)
    if mode == "per_stage":
        rollout_bytes = model.engines * model.weights_bytes
        rollout_s = transfer_s(model.weights_bytes, scenario) + vllm_start_s(model, scenario)
        return StepCost(model.engines, 1, rollout_bytes + trainer_bytes, 1, rollout_s + trainer_s, compute_s(model))
    if mode == "colocated":
        n = steps_per_chunk
        saves = math.ceil(n / checkpoint_every)  # the last one is trainer_restart's save
        records_s = (saves - 1) * model.checkpoint_bytes / model.nodes / scenario.save_bytes_s
        # vLLM gets its weights from the trainer, not the store
        chunk_s = trainer_s + vllm_start_s(model, scenario) + records_s
        return StepCost(
            model.engines / n,
            1 / n,
            trainer_bytes / n,
            saves / n,
            chunk_s / n + sync_s(model, scenario),
            compute_s(model),
        )
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def chunk_for_share(model: Model, scenario: Scenario, target: float = 0.05, limit: int = 10_000) -> int:
    """The smallest steps_per_chunk whose colocated overhead share is under target."""
    for n in range(1, limit + 1):
        if step_cost(model, "colocated", n, scenario).share < target:
            return n
    raise ValueError(f"no steps_per_chunk up to {limit} keeps {model.name}'s share under {target:.0%}")


LOW, HIGH = scenarios()


# One step off policy (dapo.execution.overlap): the rollout of step t+1 beside the update of step t, on
# GPUs split into the two roles. Decoding is bound by memory bandwidth and by the longest
# responses, not by the GPU count: a rollout on part of the GPUs is taken to last as long as on
# all of them (verl's one-step-off 7B figure, 749 -> 520 s/step on 16 GPUs = 1.44x, is this
# bound: docs/advance/one_step_off.md), while the update's time grows as its GPUs shrink.
# NCCL between nodes, for the weights broadcast after each update (InfiniBand NDR, 400 Gb/s a GPU).
INTER_NODE_BYTES_S = 50e9


@dataclass(frozen=True)
class OverlapCost:
    """A step synchronous (colocated: rollout and update take turns on all GPUs) against one
    step off policy (the GPUs split, rollout and update at once)."""

    sync_step_s: float
    off_step_s: float
    trainer_gpus: int
    rollout_gpus: int
    broadcast_s: float

    @property
    def speedup(self) -> float:
        return self.sync_step_s / self.off_step_s


def one_step_off_cost(
    model: Model, scenario: Scenario, steps_per_chunk: int = 10, checkpoint_every: int = 5
) -> OverlapCost:
    """One step off against synchronous colocated, per step, chunk overheads included in both.
    The split gives the trainer the fewest GPUs whose update is no longer than the rollout
    (the rollout keeps whole vLLM engines); the step is then the rollout's time plus the
    weights' broadcast, so its speed-up is at most 1 / (1 - UPDATE_SHARE) = 1.43x."""
    sync = step_cost(model, "colocated", steps_per_chunk, scenario, checkpoint_every)
    rollout, update = (1 - UPDATE_SHARE) * sync.compute_s, UPDATE_SHARE * sync.compute_s
    splits = [g for g in range(1, model.gpus) if (model.gpus - g) % model.tensor_parallel == 0]
    if not splits:
        raise ValueError(
            f"{model.name}: {model.gpus} GPU(s) cannot hold a trainer and a vLLM engine of {model.tensor_parallel}"
        )
    trainer_gpus = next((g for g in splits if update * model.gpus / g <= rollout), splits[-1])
    broadcast = model.weights_bytes / INTER_NODE_BYTES_S
    chunk_overhead = sync.overhead_s - sync_s(model, scenario)  # restarts and records: the same in both modes
    off = max(rollout, update * model.gpus / trainer_gpus) + broadcast + chunk_overhead
    return OverlapCost(sync.compute_s + sync.overhead_s, off, trainer_gpus, model.gpus - trainer_gpus, broadcast)
