"""Rollout throughput: the vLLM backend against the transformers fallback, same model and prompts.

    PYTHONPATH=. .venv/bin/python benchmarks/rollout.py                 # tiny random-init policy
    PYTHONPATH=. .venv/bin/python benchmarks/rollout.py --model-dir DIR --prompts 32 --n 8 --max-tokens 32

Each backend runs in its own interpreter (so peak RSS is its own, and the
in-process vLLM engine's process-wide settings cannot touch the other), with the
same prompts and SamplingSettings:

- start:        engine construction (model load; vLLM: engine, KV cache)
- first batch:  the first generate() call (vLLM compiles a kernel here)
- steady:       a second generate() call with another seed: tokens/s = generated tokens / seconds
- reload:       load_weights() of the same checkpoint (the per-step weight swap)
- peak RSS:     ru_maxrss of the backend's process (and, in brackets, of its largest child, if any)

The default model is the tiny policy barely trained (warm start of 1 step):
it rarely emits eos, so nearly every sample runs to max_tokens and tokens/s
measures decoding rather than how early samples stop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_env, print_result, run_worker


def make_prompts(model_dir: str, count: int, seed: int) -> list[str]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from dapo.data.prompts import load_prompts, make_arithmetic_table, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.parquet"
        pq.write_table(make_arithmetic_table(count, seed=seed), path)
        records, _ = load_prompts(path)
    return [render_prompt(record, tokenizer) for record in records]


def run_backend(args) -> dict:
    """One backend, in this process: start, first batch, steady batch, reload."""
    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine

    prompts = make_prompts(args.model_dir, args.prompts, args.seed)
    settings = dict(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    import torch

    result = {"backend": args.worker}
    started = time.perf_counter()
    engine = make_rollout_engine(args.worker, args.model_dir, EngineSettings(dtype=args.dtype, max_model_len=args.max_model_len))
    result["start_s"] = time.perf_counter() - started
    try:
        for label, seed in (("first", 1), ("steady", 2)):
            started = time.perf_counter()
            completions = engine.generate(prompts, SamplingSettings(**settings, seed=seed))
            seconds = time.perf_counter() - started
            tokens = sum(len(c.token_ids) for c in completions)
            result[f"{label}_s"] = seconds
            result[f"{label}_tokens"] = tokens
            result[f"{label}_tokens_per_s"] = tokens / seconds
            result[f"{label}_truncated"] = sum(c.truncated for c in completions) / len(completions)
            result[f"{label}_threads"] = torch.get_num_threads()  # the caller's count, restored after vLLM calls
        started = time.perf_counter()
        engine.load_weights(args.model_dir)
        result["reload_s"] = time.perf_counter() - started
    finally:
        engine.close()
    # ru_maxrss is in KiB on Linux. RUSAGE_CHILDREN is the largest single child that has
    # exited (vLLM's compile workers, engine-core/worker processes in multiprocess mode).
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["children_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def spawn_backend(backend: str, args) -> dict:
    command = [sys.executable, __file__, "--worker", backend, "--model-dir", args.model_dir]
    for name in ("prompts", "n", "max_tokens", "temperature", "top_p", "seed", "dtype", "max_model_len"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = child_env()
    if args.threads:  # torch and vLLM both take their intra-op thread count from it
        env["OMP_NUM_THREADS"] = str(args.threads)
    return run_worker(command, f"the {backend} benchmark", env=env)


def print_table(results: list[dict], args) -> None:
    print(
        f"\nrollout benchmark: {args.prompts} prompts x {args.n} samples, max_tokens {args.max_tokens}, "
        f"T={args.temperature}, top_p={args.top_p}, {args.dtype}, OMP_NUM_THREADS={args.threads or os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = f"{'backend':<8}{'start s':>9}{'1st batch s':>13}{'steady s':>10}{'tokens':>8}{'tokens/s':>10}{'reload s':>10}{'peak RSS MiB':>14}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['backend']:<8}{r['start_s']:>9.2f}{r['first_s']:>13.2f}{r['steady_s']:>10.2f}{r['steady_tokens']:>8d}"
            f"{r['steady_tokens_per_s']:>10.0f}{r['reload_s']:>10.3f}{r['peak_rss_mib']:>14.0f}"
            + (f"  (child {r['children_peak_rss_mib']:.0f})" if r["children_peak_rss_mib"] > 1 else "")
        )
    by_backend = {r["backend"]: r for r in results}
    if {"vllm", "hf"} <= by_backend.keys():
        v, h = by_backend["vllm"], by_backend["hf"]
        print(
            f"{'vllm/hf':<8}{v['start_s'] / h['start_s']:>9.1f}{v['first_s'] / h['first_s']:>13.2f}{v['steady_s'] / h['steady_s']:>10.2f}"
            f"{'':>8}{v['steady_tokens_per_s'] / h['steady_tokens_per_s']:>10.2f}{v['reload_s'] / h['reload_s']:>10.2f}"
            f"{v['peak_rss_mib'] / h['peak_rss_mib']:>14.2f}"
        )
    print("(tokens and tokens/s: the steady batch; truncated share of samples: "
          + ", ".join(f"{r['backend']} {r['steady_truncated']:.0%}" for r in results) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="a Hugging Face checkpoint dir; default: build the tiny policy in a temp dir")
    parser.add_argument("--warm-start-steps", type=int, default=1, help="warm start of the built tiny policy")
    parser.add_argument("--backends", default="vllm,hf")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both backends (default: as set)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one backend here
    args = parser.parse_args()

    if args.worker:
        print_result(run_backend(args))
        return

    with tempfile.TemporaryDirectory() as tmp:
        if not args.model_dir:
            from dapo.model.policy import TinyPolicySpec, build_tiny_policy

            args.model_dir = str(Path(tmp) / "policy")
            build_tiny_policy(args.model_dir, TinyPolicySpec(warm_start_steps=args.warm_start_steps))
        results = [spawn_backend(backend.strip(), args) for backend in args.backends.split(",") if backend.strip()]
        print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
