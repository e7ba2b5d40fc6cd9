"""What one DAPO step costs on a cluster beyond its compute, per execution mode, and
paper_32b's run budget: the cost model of dapo.cluster.cluster_cost (its docstring says what it
models and leaves out), printed as tables at 1.5B, 7B and 32B with every figure's source.
The model's measured inputs are read here from RESULTS.md section 4.

    make bench-cluster-cost
    PYTHONPATH=. .venv/bin/python benchmarks/cluster_cost.py
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dapo.cluster import run_budget
from dapo.cluster.cluster_cost import (
    CHECKPOINT_BYTES_PER_PARAM, DEEPSPEED_START_BILLIONS, DEEPSPEED_START_S, FAST_CLIENT_MIB_S, GPUS_PER_NODE, MODES, NCCL_SYNC_BILLIONS,
    NCCL_SYNC_S, SLOW_CLIENT_MIB_S, UPDATE_SHARE, VERL_GPUS, VERL_STEP_S, VLLM_CACHED_START_S, VLLM_COLD_START_S, VLLM_P2P_CHECK_S,
    WEIGHT_BYTES_PER_PARAM, Model, Scenario, chunk_for_share, compute_s, one_step_off_cost, scenarios, step_cost,
)
from dapo.config import DAPOConfig

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PAPER = DAPOConfig.paper_32b()
TARGET_SHARE = 0.05  # the steps_per_chunk that keeps colocated's restart share under 5% at 32B
FIXED_MICRO_BATCH_RATIO = re.compile(r"update time, fixed rows / token budget, paper spread: ([0-9.]+)x")
"""RESULTS.md section 10's measured ratio (benchmarks/micro_batches.py)."""

# Qwen2.5 sizes (model cards: 1.54B, 7.61B); 32B is paper_32b's own figure and cluster.
# Assumed clusters for the smaller ones: 1.5B on one node (vLLM TP 1), 7B on 4 nodes (TP 2).
MODELS = (
    Model("1.5B", 1.54, nodes=1, tensor_parallel=1),
    Model("7B", 7.61, nodes=4, tensor_parallel=2),
    dataclasses.replace(Model.of(PAPER), name="32B"),
)


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
        print("\n".join(table(model, sorted({DAPOConfig().steps_per_chunk, PAPER.steps_per_chunk, enough}), low, high)))
    print(f"\nrecommended at 32B: steps_per_chunk = {recommended} (colocated share "
          f"{step_cost(big, 'colocated', recommended, high).share:.2%} at the high end, "
          f"{step_cost(big, 'colocated', recommended - 1, high).share:.2%} with one step less; "
          f"{step_cost(big, 'colocated', recommended, low).share:.2%} at the low end)")
    print(f"\none step off policy (dapo.execution.overlap) against synchronous colocated, {DAPOConfig().steps_per_chunk}-step chunks: "
          f"the rollout ({1 - UPDATE_SHARE:.0%} of a step) taken to last as long on part of the GPUs, the update on the rest; "
          f"peers: verl 7B 749 -> 520 s (1.44x), NeMo-RL 192 -> 152 s (1.26x)\n")
    print("| model | GPUs trainer / rollout | broadcast s | sync min/step (low-high) | one step off min/step (low-high) "
          "| speed-up (low-high) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        costs = [one_step_off_cost(model, scenario) for scenario in (low, high)]
        print(f"| {model.name} | {costs[0].trainer_gpus} / {costs[0].rollout_gpus} | {costs[0].broadcast_s:.2f} "
              f"| {costs[0].sync_step_s / 60:.1f}-{costs[1].sync_step_s / 60:.1f} | {costs[0].off_step_s / 60:.1f}-{costs[1].off_step_s / 60:.1f} "
              f"| {costs[0].speedup:.2f}-{costs[1].speedup:.2f}x |")
    fixed = float(FIXED_MICRO_BATCH_RATIO.search(RESULTS.read_text()).group(1))
    extra = UPDATE_SHARE * (fixed - 1)
    print(f"\nmicro-batches: the step compute above is verl's, which packs micro-batches by tokens "
          f"(paper_32b: max_tokens_per_micro_batch). By a fixed row count the update ({UPDATE_SHARE:.0%} of a step) takes "
          f"{fixed:.2f}x as long at the paper's length spread (measured, RESULTS.md section 10): "
          f"+{extra:.0%} a step, +{extra * compute_s(big) / 60:.1f} min at 32B")
    print(f"\nrun budget of paper_32b (dapo.cluster.run_budget: each timeout covers an attempt, twice it every attempt from "
          f"where a retry restarts; high end, {run_budget.HEADROOM}x headroom; a step of {run_budget.step_seconds(PAPER) / 60:.1f} min "
          f"unless measured_step_minutes says otherwise; steps_per_chunk {PAPER.steps_per_chunk}, val_every {PAPER.val_every}, "
          f"{PAPER.task_retries} retries of its own and propeller's {run_budget.SYSTEM_RETRIES} after system failures)")
    for config in (PAPER, PAPER.replace(execution="per_stage")):
        print(f"\n{config.execution}:\n")
        print("\n".join(run_budget.budget_lines(config)))
    print("\nsources")
    print("\n".join(sources(low, high, handoff)))


if __name__ == "__main__":
    main()
