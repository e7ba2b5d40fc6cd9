"""What one DAPO step costs on a cluster beyond its compute, per execution mode: a model.

No GPU or cluster has been available to us, so this is arithmetic, not a measurement.
Its inputs are our own measured components (bytes per parameter of the weights and of
the whole DeepSpeed checkpoint, DAPOConfig; the checkpoint save rate and the in-place
reload vs engine start ratio, benchmarks/RESULTS.md section 4) and public figures, each
named below with its source. Two execution modes:

- per_stage (the code today): every step is a chain of fresh pods. Each rollout pod
  downloads the bf16 weights and starts vLLM; the policy step's pods each download the
  whole checkpoint (weights + optimizer state), start DeepSpeed, update once, save, and
  rank 0's pod uploads the new checkpoint as the task's output.
- colocated (dapo.colocated): steps_per_chunk steps inside one GPU task (the trainer's
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

    make bench-cluster-cost
    PYTHONPATH=. .venv/bin/python benchmarks/cluster_cost.py
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from dapo.config import DAPOConfig

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PAPER = DAPOConfig.paper_32b()
MIB = 2**20
MODES = ("per_stage", "colocated")
TARGET_SHARE = 0.05  # issue 14: the steps_per_chunk that keeps colocated's restart share under 5% at 32B
DEFAULT_CHUNK = 10  # dapo_loop's steps_per_chunk today (README, "How the loop is a Flyte DAG")

# Bytes a parameter, from DAPOConfig (what the pods' disks are sized with): bf16 weights 2;
# the whole ZeRO checkpoint 16 = weights twice + fp32 master weights + two fp32 Adam moments,
# the layout measured in RESULTS.md section 4 (5.00x the weights in fp32).
WEIGHT_BYTES_PER_PARAM = PAPER.weights_bytes / (PAPER.model_size_billions * 1e9)
CHECKPOINT_BYTES_PER_PARAM = PAPER.checkpoint_bytes / (PAPER.model_size_billions * 1e9)

GPUS_PER_NODE = PAPER.trainer_nproc_per_node  # 8, the paper's nodes (DESIGN.md)
# One whole DAPO step of verl's 32B recipe on 16 x 8 GPUs: 230 steps in 5 days (volcengine/verl#795).
# verl keeps vLLM and the trainer resident (no restarts), so this is the step's compute.
VERL_STEP_S = 5 * 24 * 3600 / 230
VERL_GPUS = PAPER.trainer_nnodes * GPUS_PER_NODE
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
FIXED_MICRO_BATCH_RATIO = re.compile(r"update time, fixed rows / token budget, paper spread: ([0-9.]+)x")
"""RESULTS.md section 10's measured ratio (benchmarks/micro_batches.py)."""


@dataclass(frozen=True)
class Model:
    """A policy size and the cluster slice it runs on: nodes of GPUS_PER_NODE GPUs,
    one vLLM engine per tensor_parallel GPUs, rollout and training taking turns on them."""

    name: str
    billions: float
    nodes: int
    tensor_parallel: int

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    @property
    def engines(self) -> int:
        """vLLM engines: rollout pods per round in per_stage, resident engines in colocated."""
        return self.gpus // self.tensor_parallel

    @property
    def weights_bytes(self) -> float:
        return self.billions * 1e9 * WEIGHT_BYTES_PER_PARAM

    @property
    def checkpoint_bytes(self) -> float:
        return self.billions * 1e9 * CHECKPOINT_BYTES_PER_PARAM


# Qwen2.5 sizes (model cards: 1.54B, 7.61B); 32B is paper_32b's own figure and cluster.
# Assumed clusters for the smaller ones: 1.5B on one node (vLLM TP 1), 7B on 4 nodes (TP 2).
MODELS = (
    Model("1.5B", 1.54, nodes=1, tensor_parallel=1),
    Model("7B", 7.61, nodes=4, tensor_parallel=2),
    Model("32B", PAPER.model_size_billions, nodes=PAPER.trainer_nnodes, tensor_parallel=PAPER.tensor_parallel_size),
)


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


def handoff_figures(results_text: str) -> dict[str, float]:
    """The largest size's row of RESULTS.md's weights hand-off table (section 4),
    as {column header: value}."""
    lines = results_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| size | params |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().rstrip("x").replace(",", "") for cell in line.strip("|").split("|")]
        rows.append(dict(zip(header[1:], [float(cell) for cell in cells[1:]])))
    return max(rows, key=lambda row: row["params"])


def scenarios(handoff: dict[str, float]) -> tuple[Scenario, Scenario]:
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
    return VERL_STEP_S * (model.billions / PAPER.model_size_billions) * (VERL_GPUS / model.gpus)


def transfer_s(nbytes: float, scenario: Scenario) -> float:
    return nbytes / (scenario.client_mib_s * MIB)


def vllm_start_s(model: Model, scenario: Scenario) -> float:
    return scenario.vllm_start_s + (scenario.p2p_check_s if model.tensor_parallel > 1 else 0.0)


def sync_s(model: Model, scenario: Scenario) -> float:
    """Colocated: the new weights from the trainer into vLLM in memory, once a step."""
    return max(NCCL_SYNC_S * model.billions / NCCL_SYNC_BILLIONS, scenario.sync_share_of_start * vllm_start_s(model, scenario))


def trainer_restart(model: Model, scenario: Scenario) -> tuple[float, float]:
    """(bytes through the store, seconds) of one trainer start and end: each node downloads
    the whole checkpoint (policy_step: one download per node, all nodes at once), DeepSpeed
    starts, each node saves its share, rank 0's pod uploads the checkpoint (the task's output)."""
    ckpt = model.checkpoint_bytes
    seconds = transfer_s(ckpt, scenario) + DEEPSPEED_START_S * model.billions / DEEPSPEED_START_BILLIONS
    seconds += ckpt / model.nodes / scenario.save_bytes_s + transfer_s(ckpt, scenario)
    return (model.nodes + 1) * ckpt, seconds


def step_cost(
    model: Model, mode: str, steps_per_chunk: int, scenario: Scenario, checkpoint_every: int = PAPER.colocated_checkpoint_every
) -> StepCost:
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
        chunk_s = trainer_s + vllm_start_s(model, scenario) + records_s  # vLLM gets its weights from the trainer, not the store
        return StepCost(model.engines / n, 1 / n, trainer_bytes / n, saves / n, chunk_s / n + sync_s(model, scenario), compute_s(model))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def chunk_for_share(model: Model, scenario: Scenario, target: float = TARGET_SHARE, limit: int = 10_000) -> int:
    """The smallest steps_per_chunk whose colocated overhead share is under target."""
    for n in range(1, limit + 1):
        if step_cost(model, "colocated", n, scenario).share < target:
            return n
    raise ValueError(f"no steps_per_chunk up to {limit} keeps {model.name}'s share under {target:.0%}")


def table(model: Model, chunks: list[int], low: Scenario, high: Scenario) -> list[str]:
    """Markdown rows: per_stage, then colocated at each chunk length; low-high ranges."""
    rows = [
        "| mode | steps/chunk | vLLM starts/step | DeepSpeed starts/step | GB moved/step | checkpoint writes/step "
        "| overhead min/step (low-high) | share of step (low-high) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, n in [("per_stage", 1)] + [("colocated", n) for n in chunks]:
        a, b = step_cost(model, mode, n, low), step_cost(model, mode, n, high)
        rows.append(f"| {mode} | {n if mode == 'colocated' else '1 (every step)'} | {a.vllm_starts:.3g} | {a.deepspeed_starts:.3g} "
                    f"| {a.bytes_moved / 1e9:,.1f} | {a.checkpoint_writes:.3g} | {a.overhead_s / 60:.1f}-{b.overhead_s / 60:.1f} "
                    f"| {a.share:.2%}-{b.share:.2%} |")
    return rows


def sources(low: Scenario, high: Scenario, handoff: dict[str, float]) -> list[str]:
    return [
        f"- bytes/param: bf16 weights {WEIGHT_BYTES_PER_PARAM:g}, whole DeepSpeed checkpoint {CHECKPOINT_BYTES_PER_PARAM:g} "
        f"(DAPOConfig.weights_bytes / checkpoint_bytes; measured layout: {handoff['ratio']:.2f}x the fp32 weights, RESULTS.md section 4)",
        f"- checkpoint save, one writer: {low.save_bytes_s / 1e6:.0f} MB/s (RESULTS.md section 4, {handoff['params'] / 1e6:.0f}M params, "
        "dev VM disk; each trainer node saves its share)",
        f"- in-place reload / engine start: {high.sync_share_of_start:.2f} (RESULTS.md section 4, vLLM on CPU): "
        "colocated's per-step sync at the high end",
        f"- in-memory sync: {NCCL_SYNC_S} s at {NCCL_SYNC_BILLIONS}B, NCCL reshard (NVIDIA-NeMo/RL#2413), scaled by parameters: the low end",
        f"- step compute: {VERL_STEP_S / 60:.1f} min at 32B on {VERL_GPUS} GPUs, 230 steps in 5 days (volcengine/verl#795), "
        "scaled by parameters per GPU",
        f"- vLLM start: {VLLM_COLD_START_S} s cold (weights 10 + torch.compile 70 + CUDA graphs 60) + P2P check {VLLM_P2P_CHECK_S} s "
        f"with TP > 1 (vllm-project/vllm#19824); {VLLM_CACHED_START_S} s with a reused compile cache (vllm#20264)",
        f"- object store per client: {SLOW_CLIENT_MIB_S} MiB/s fsspec/s3fs, {FAST_CLIENT_MIB_S} MiB/s aws-cli CRT "
        "(ray-project/ray#38695); FlyteFile 10x slower than s5cmd (flyteorg/flyte#6455)",
        f"- DeepSpeed start: {DEEPSPEED_START_S / 60:.0f} min for a {DEEPSPEED_START_BILLIONS}B model with HF "
        "(deepspeedai/DeepSpeed#7369), scaled by parameters",
        f"- colocated records: a checkpoint every {PAPER.colocated_checkpoint_every} steps (paper_32b's "
        "colocated_checkpoint_every), each node its share at the save rate above",
        "- clusters: 32B as paper_32b (16 nodes x 8 GPUs, vLLM TP 4, 32 rollout pods); assumed 1.5B on 1 node (TP 1), "
        "7B on 4 nodes (TP 2); Qwen2.5 sizes 1.54B, 7.61B, 32.8B",
        "- left out: pod scheduling and image pulls, Flyte's task overhead, validation, dynamic-sampling rounds past "
        "the first (each costs per_stage another wave of rollout pods): per_stage's figures are a lower bound",
    ]


def main() -> None:
    handoff = handoff_figures(RESULTS.read_text())
    low, high = scenarios(handoff)
    big = next(model for model in MODELS if model.name == "32B")
    recommended = chunk_for_share(big, high)
    print("One DAPO step's restarts and copies by execution mode (a model, not a measurement).")
    print("low = 700 MiB/s per client, cached compile, NCCL-speed sync; high = 120 MiB/s, cold compile, slow sync.")
    for model in MODELS:
        enough = chunk_for_share(model, high)
        print(f"\n### {model.name}: {model.billions:g}B params, {model.nodes} x {GPUS_PER_NODE} GPUs, vLLM TP {model.tensor_parallel} "
              f"({model.engines} engines), compute {compute_s(model) / 60:.1f} min/step; "
              f"colocated under {TARGET_SHARE:.0%} from steps_per_chunk {chunk_for_share(model, low)} (low) / {enough} (high)\n")
        print("\n".join(table(model, sorted({DEFAULT_CHUNK, enough}), low, high)))
    print(f"\nrecommended at 32B: steps_per_chunk = {recommended} (colocated share "
          f"{step_cost(big, 'colocated', recommended, high).share:.2%} at the high end, "
          f"{step_cost(big, 'colocated', recommended - 1, high).share:.2%} with one step less; "
          f"{step_cost(big, 'colocated', recommended, low).share:.2%} at the low end)")
    fixed = float(FIXED_MICRO_BATCH_RATIO.search(RESULTS.read_text()).group(1))
    extra = UPDATE_SHARE * (fixed - 1)
    print(f"\nmicro-batches: the step compute above is verl's, which packs micro-batches by tokens "
          f"(paper_32b: max_tokens_per_micro_batch). By a fixed row count the update ({UPDATE_SHARE:.0%} of a step) takes "
          f"{fixed:.2f}x as long at the paper's length spread (measured, RESULTS.md section 10): "
          f"+{extra:.0%} a step, +{extra * compute_s(big) / 60:.1f} min at 32B")
    print("\nsources")
    print("\n".join(sources(low, high, handoff)))


if __name__ == "__main__":
    main()
