"""Policy-step cost: DeepSpeed (ZeRO-2) vs the plain torch backend on the same tiny model and batch.

Each backend runs in its own process (so peak memory is its own): build the trainer,
one warm-up policy_update, then --repeats timed policy_updates on the same scored
batch (16 prompts x 8 responses by default: old-log-prob pass + the mini-batch
updates), then one save; --rounds alternates the backends' processes and keeps each
one's best median (the machine may be shared). Reported: trainer start, step time (median, min, max),
save time, peak RSS of the process and its growth over the post-import baseline
(CPU), or peak allocated device memory (CUDA).

    PYTHONPATH=. .venv/bin/python benchmarks/train_step.py [--repeats 5] [--rounds 2] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_result, rss_mib, run_worker


def scored_batch(prompts: int, samples: int, seed: int = 0):
    import pyarrow as pa

    from dapo.algorithm.batch import SCORED_SCHEMA

    rng = random.Random(seed)
    rows = []
    for g in range(prompts):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(40, 80))]
        for i in range(samples):
            response = [rng.randrange(1, 300) for _ in range(rng.randrange(8, 25))]
            reward = 1.0 if (i + g) % 3 == 0 else -1.0
            rows.append(dict(
                group_id=f"g{g}", prompt_uid=f"p{g}", sample_index=i, prompt="", ground_truth="",
                prompt_token_ids=prompt, response_token_ids=response, response_text="",
                rollout_log_probs=[-5.0] * len(response), truncated=len(response) == 24,
                reward=reward, acc=float(reward > 0), score=reward, overlong_penalty=0.0, format_score=0.0, unverified=0.0,
            ))
    return pa.Table.from_pylist(rows, schema=SCORED_SCHEMA)


def worker(args) -> None:
    import torch

    from dapo.config import DAPOConfig
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import policy_update

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backend == "deepspeed":
        import deepspeed  # noqa: F401  (import cost is not part of the step)
    config = DAPOConfig.tiny_cpu().replace(
        trainer_backend=args.backend, zero_stage=2, dtype="float32",
        n_samples_per_prompt=args.samples, train_prompt_bsz=args.prompts, gen_prompt_bsz=args.prompts,
        ppo_mini_batch_size=args.mini_batch, micro_batch_size=args.micro_batch, max_tokens_per_micro_batch=0,
    )
    table = scored_batch(args.prompts, args.samples)
    cuda = torch.cuda.is_available()
    baseline = rss_mib()
    started = time.perf_counter()
    trainer = make_trainer(config, args.model_dir)
    start_s = time.perf_counter() - started
    policy_update(trainer, table, config, step=0, temperature=1.0)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(1, args.repeats + 1):
        started = time.perf_counter()
        metrics = policy_update(trainer, table, config, step=step, temperature=1.0)
        times.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        trainer.save(Path(out) / "ckpt")
        save_s = time.perf_counter() - started
    trainer.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_result({
        "backend": args.backend,
        "start_s": start_s,
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "save_s": save_s,
        "peak_rss_mib": peak_rss,
        "rss_growth_mib": peak_rss - baseline,
        "peak_device_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "updates_per_step": metrics["num_updates"],
        "tokens": metrics["tokens"],
        "grad_norm_last": metrics["grad_norm"],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="", help="tiny policy dir (built into a temp dir if empty)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--mini-batch", type=int, default=8, help="prompts per update")
    parser.add_argument("--micro-batch", type=int, default=32, help="responses per forward/backward (0 = whole)")
    parser.add_argument("--backends", default="torch,deepspeed")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per backend; the best median is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--worker", dest="backend", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend:
        worker(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if not model_dir:
            from dapo.model.policy import TinyPolicySpec, build_tiny_policy

            model_dir = os.path.join(tmp, "policy")
            print("building the tiny policy ...", flush=True)
            build_tiny_policy(model_dir, TinyPolicySpec(warm_start_steps=10))
        results: dict[str, dict] = {}
        runs = [backend for _ in range(args.rounds) for backend in args.backends.split(",")]
        for backend in runs:  # alternating rounds, so a busy machine's load drifts over both alike
            command = [sys.executable, __file__, "--worker", backend, "--model-dir", model_dir,
                       "--repeats", str(args.repeats), "--prompts", str(args.prompts), "--samples", str(args.samples),
                       "--mini-batch", str(args.mini_batch), "--micro-batch", str(args.micro_batch), "--threads", str(args.threads)]
            result = run_worker(command, f"the {backend} worker")
            print(f"  {backend}: step median {result['step_s_median']:.3f} s, peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
            best = results.get(backend)
            if best is None or result["step_s_median"] < best["step_s_median"]:
                results[backend] = result

    print(f"\nbatch: {args.prompts} prompts x {args.samples} responses, mini-batch {args.mini_batch} prompts, "
          f"micro-batch {args.micro_batch or 'whole'}, {args.repeats} timed steps after 1 warm-up, "
          f"best of {args.rounds} alternating round(s), torch threads {args.threads or 'default'}; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = f"{'backend':<10} {'start s':>8} {'step s (med)':>13} {'min':>7} {'max':>7} {'save s':>7} {'peak RSS MiB':>13} {'RSS growth':>11}"
    print(header)
    for name, r in results.items():
        print(f"{name:<10} {r['start_s']:>8.2f} {r['step_s_median']:>13.3f} {r['step_s_min']:>7.3f} {r['step_s_max']:>7.3f} "
              f"{r['save_s']:>7.2f} {r['peak_rss_mib']:>13.0f} {r['rss_growth_mib']:>11.0f}")
        if r["peak_device_mib"] is not None:
            print(f"{'':<10} peak device memory {r['peak_device_mib']:.0f} MiB")
    if "torch" in results and "deepspeed" in results:
        ds, pt = results["deepspeed"], results["torch"]
        print(f"\ndeepspeed / torch: step time x{ds['step_s_median'] / pt['step_s_median']:.2f} (median), "
              f"x{ds['step_s_min'] / pt['step_s_min']:.2f} (min); peak RSS x{ds['peak_rss_mib'] / pt['peak_rss_mib']:.2f}; "
              f"RSS growth x{ds['rss_growth_mib'] / max(pt['rss_growth_mib'], 1e-9):.2f}")
        print(f"grad norm of the last update: deepspeed {ds['grad_norm_last']:.6f}, torch {pt['grad_norm_last']:.6f}")


if __name__ == "__main__":
    main()
