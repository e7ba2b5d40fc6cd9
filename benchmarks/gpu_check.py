"""What benchmarks/gpu_check.sh runs once the venv is ready: on one GPU (or --cpu, to check the
script itself), all with generated policies (no hub):

1. gaps: vLLM-vs-transformers sampled-token log-prob gap before and after an in-place reload
   and on a fresh engine, tied and untied, per dtype (benchmarks/reload_gap.py); the bf16
   row sets DAPOConfig's bf16 default (dapo.config.ROLLOUT_GAP_DEFAULTS).
2. step: one DAPO step through the pipeline functions (rollout -> verify_rewards ->
   filter_groups -> policy_step with DeepSpeed -> the new checkpoint reloaded in place ->
   rollout again) on the tied policy, with the guard's metrics.
3. colocated: three steps of execution="colocated" (dapo.colocated: trainer and vLLM
   resident, weights synced in memory), once as they are and once with vLLM's memory
   released during each update (colocated_release_rollout_memory: sleep mode): each
   step's sync time, the rollout guard's gap after the sync, tokens/s, the whole GPU's
   peak memory during the updates and the peak of the three steps.
4. speed (run first, in its own processes): vLLM tokens/s against transformers' generate
   (benchmarks/rollout.py).
5. peak GPU memory (torch's allocator in this process, and nvidia-smi).

Without vLLM (--no-vllm, chosen by itself when `import vllm` fails: a machine with CUDA torch,
transformers and DeepSpeed only) the vLLM parts above are skipped, and the same questions are
asked of transformers' generate as the rollout engine (rollout_backend="hf"), DeepSpeed the
trainer: hf_colocated (three colocated steps, tied and untied), hf_step (one per-stage step,
tied) and hf_gap (trainer vs HF engine after an in-memory sync and on a fresh engine):
benchmarks/gpu_check_hf.py.

Writes OUT/gpu_check.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def one_step(work: Path, model_dir: str, dtype: str) -> dict:
    from dapo.stages import generation, guard, scoring, setup, training
    from dapo.sampling import SamplingState

    from benchmarks.gpu_check_hf import check_config

    config = check_config(model_dir, dtype)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")
    started = time.perf_counter()
    kept, state = generation.sample_batch(config, str(work / "policy-0"), str(work / "data"), 0)
    metrics = training.policy_step(config, str(work / "policy-0"), kept, state, 0, work / "policy-1")
    guard.check_rollout_guard(config, metrics, 0)
    # the new checkpoint into the live engine (in place), then its own rollout and its gap
    table, _ = generation.rollout(config, str(work / "policy-1"), str(work / "data"), 1, 0)
    scored = scoring.verify_rewards(config, table, 1)
    state = SamplingState(rounds=1, generated_groups=1, kept_groups=1)
    after = training.policy_step(config, str(work / "policy-1"), scored, state, 1, work / "policy-2", regenerate=None)
    engine = generation.policy_engine(config, str(work / "policy-1"))
    keys = ("guard/rollout_logprob_gap", "guard/threshold", "guard/regenerated", "guard/stopped", "actor/num_updates", "step/skipped",
            "sampling/kept_groups", "rollout/tokens_per_s", "actor/step_seconds")
    return {
        "dtype": dtype,
        "step0": {k: metrics.get(k) for k in keys},
        "step1_after_in_place_reload": {k: after.get(k) for k in keys},
        "reload_mode": engine.last_reload_mode,
        "seconds": time.perf_counter() - started,
    }


def colocated_steps(work: Path, model_dir: str, dtype: str, on_gpu: bool) -> dict:
    """Three colocated steps, vLLM's memory kept and released during the updates."""
    import dapo.colocated
    from dapo.stages import setup
    from dapo.colocated import run_colocated
    from dapo.rollout import close_cached_rollout_engine

    from benchmarks.gpu_check_hf import GpuMemorySampler, check_config

    config = check_config(model_dir, dtype).replace(execution="colocated")
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")
    sampler = GpuMemorySampler() if on_gpu else None
    update, during_updates = dapo.colocated.train_on_batch, []

    def measured_update(*args, **kwargs):  # the whole GPU's peak while the trainer updates
        if sampler:
            sampler.take_peak()
        try:
            return update(*args, **kwargs)
        finally:
            during_updates.append(sampler.take_peak() if sampler else None)

    keys = ("sync/seconds", "guard/rollout_logprob_gap", "guard/regenerated", "rollout/tokens_per_s", "policy_step/seconds",
            "step/skipped")
    report = {"dtype": dtype, "threshold": config.rollout_gap_threshold}
    dapo.colocated.train_on_batch = measured_update
    try:
        for release in (False, True):
            close_cached_rollout_engine()
            during_updates.clear()
            if sampler:
                sampler.take_peak()
            started = time.perf_counter()
            result = run_colocated(config.replace(colocated_release_rollout_memory=release), str(work / "policy-0"),
                                   str(work / "data"), 0, 3, work / f"records-release-{release}")
            report["released" if release else "kept"] = {
                "steps": [{k: m.get(k) for k in keys} for m in result.step_metrics],
                "seconds": time.perf_counter() - started,
                "gpu_used_mib_during_updates": during_updates[:],
                "gpu_used_mib_peak": sampler.take_peak() if sampler else None,
            }
    finally:
        dapo.colocated.train_on_batch = update
        if sampler:
            sampler.stop()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check"))
    parser.add_argument("--cpu", action="store_true", help="run on CPU (fp32 only, smaller) to check the script")
    parser.add_argument("--parts", help="default: speed,gaps,step,colocated; with --no-vllm: hf_colocated,hf_step,hf_gap")
    parser.add_argument("--no-vllm", action="store_true",
                        help="skip the vLLM parts; run the hf-rollout parts (the default when vllm cannot be imported)")
    parser.add_argument("--dtypes", nargs="+", help="gap dtypes (default: bfloat16 on a GPU, float32 on CPU)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not args.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    import torch

    from benchmarks.reload_gap import measure
    from dapo.policy_matrix import PolicyLayout, build_policy
    from dapo.rollout import close_cached_rollout_engine

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not on_gpu:
        sys.exit("no CUDA device visible (use --cpu to check the script on a CPU)")
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    dtypes = args.dtypes or (["bfloat16"] if on_gpu else ["float32"])
    size = dict(hidden_size=256, num_hidden_layers=4) if on_gpu else {}
    engine_options = {"gpu_memory_utilization": 0.3} if on_gpu else {}
    report: dict = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__}
    no_vllm = args.no_vllm
    if not no_vllm:
        try:
            import vllm

            report["vllm"] = vllm.__version__
        except ImportError as error:
            no_vllm = True
            report["vllm_skipped"] = f"import vllm failed ({error})"
    else:
        report["vllm_skipped"] = "--no-vllm"
    import transformers

    report["transformers"] = transformers.__version__
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except ImportError as error:
        report["deepspeed"] = f"not importable: {error}"
    parts = set((args.parts or ("hf_colocated,hf_step,hf_gap" if no_vllm else "speed,gaps,step,colocated")).split(","))
    if no_vllm:
        skipped = sorted(parts & {"speed", "gaps", "step", "colocated"})
        parts -= {"speed", "gaps", "step", "colocated"}
        log(f"vLLM parts SKIPPED ({report['vllm_skipped']}): the vLLM-vs-transformers gaps, the vLLM step and colocated run, "
            f"vLLM tokens/s{f' (asked for: {skipped})' if skipped else ''}; running the hf-rollout parts {sorted(parts)}")
        report["vllm_parts_skipped"] = ["speed", "gaps", "step", "colocated"]
        from benchmarks import gpu_check_hf

        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        gpu_check_hf.run(parts, work, size, dtypes[0], on_gpu, report)
        parts = set()

    if on_gpu and not no_vllm:
        # In-process vLLM and DeepSpeed share the GPU here: cap vLLM's share (its default
        # reserves 90% of the GPU). generation.policy_engine looks the function up at call time.
        import functools

        import dapo.rollout

        dapo.rollout.cached_rollout_engine = functools.partial(dapo.rollout.cached_rollout_engine, gpu_memory_utilization=0.3)

    if "speed" in parts:  # first: its own processes then have the whole GPU
        policy = build_policy(work / "speed-policy", PolicyLayout(tied=True, **size))
        log("tokens/s: vLLM against transformers generate")
        command = [sys.executable, str(REPO / "benchmarks" / "rollout.py"), "--model-dir", policy, "--dtype", dtypes[0],
                   "--prompts", "64" if on_gpu else "8", "--n", "8" if on_gpu else "2", "--max-tokens", "128" if on_gpu else "16",
                   "--json", str(out / "rollout_speed.json")]
        subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        report["speed"] = json.loads((out / "rollout_speed.json").read_text())

    if "gaps" in parts:
        report["gaps"] = []
        for dtype in dtypes:
            for tied in (False, True):
                log(f"gap: {'tied' if tied else 'untied'} {dtype}")
                row = measure(PolicyLayout(tied=tied, **size), dtype, work / f"gaps-{dtype}", fresh=True, **engine_options)
                log(json.dumps(row))
                report["gaps"].append(row)

    if "step" in parts:
        policy = build_policy(work / "step-policy", PolicyLayout(tied=True, warm_start_steps=100, **size))
        log("one DAPO step (vLLM + DeepSpeed) on the tied policy")
        report["step"] = one_step(work / "step", policy, dtypes[0])
        log(json.dumps(report["step"]))
        close_cached_rollout_engine()

    if "colocated" in parts:
        policy = build_policy(work / "colocated-policy", PolicyLayout(tied=True, warm_start_steps=100, **size))
        log("three colocated steps (vLLM + DeepSpeed resident, weights synced in memory) on the tied policy")
        report["colocated"] = colocated_steps(work / "colocated", policy, dtypes[0], on_gpu)
        log(json.dumps(report["colocated"]))
        close_cached_rollout_engine()

    if on_gpu:
        # with --no-vllm the parts reset torch's peak per step: their overall peak is peak_gpu_allocated_gib_torch_overall
        report["peak_gpu_memory_gib_torch"] = torch.cuda.max_memory_reserved() / 2**30

    if on_gpu:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            report["nvidia_smi_memory_now"] = used
        except (OSError, subprocess.CalledProcessError):
            pass
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
