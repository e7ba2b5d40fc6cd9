"""Policy-update cost by micro-batch plan: fixed row count (padded) vs a token budget
(length-sorted, padded) vs a token budget packed (remove_padding) under sdpa's mask and
under our varlen sdpa (dapo.model.varlen_attention), on batches of mixed lengths.

Two length spreads:
- paper: the DAPO paper's, scaled to this machine by 1/20: responses up to 1,024 tokens
  (the paper's 20,480), 10% truncated at the maximum, the rest log-uniform from 1/200 of
  it (~100 to ~20,000 tokens at full scale), prompts of 16-96 tokens;
- long_task: the embedded long_arithmetic task's worked solutions (half wordy), tokenized
  by the embedded tokenizer.

The fixed plan has --micro-batch rows a forward; the token budget is that many rows of the
longest prompt + response, so both bound a forward's tokens (activation memory) alike and
only the padding differs. Each plan runs in its own process (its peak memory its own, the
torch backend, one thread per process as in a 2-core CI runner): a warm-up update, then
--repeats timed policy_updates (the log-prob pass and the mini-batch updates) of the same
batch; --rounds alternates the plans' processes, keeping each plan's best median.
Reported: step time, the tokens the forwards computed (padding included), and the peak
RSS growth over the trainer's start.

    PYTHONPATH=. .venv/bin/python benchmarks/micro_batches.py [--spread paper,long_task]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time

from benchmarks.common import chosen, peak_rss_mib, print_result, rss_mib, run_worker

PLANS = ("fixed", "budget", "packed", "varlen")
SPREADS = ("paper", "long_task")
MAX_RESPONSE = {"paper": 1024, "long_task": 256}
MAX_PROMPT = {"paper": 96, "long_task": 128}


def lengths(spread: str, rows: int, model_dir: str, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of each row."""
    rng = random.Random(seed)
    if spread == "paper":
        top = MAX_RESPONSE[spread]
        return [(rng.randint(16, MAX_PROMPT[spread]),
                 top if rng.random() < 0.1 else round(math.exp(rng.uniform(math.log(top / 200), math.log(top)))))
                for _ in range(rows)]
    from transformers import AutoTokenizer

    from dapo.model.policy import warm_start_examples

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = warm_start_examples(rng, rows, task="long_arithmetic", verbose_share=0.5)
    return [(len(tokenizer(p).input_ids), min(MAX_RESPONSE[spread], len(tokenizer(r).input_ids) + 1)) for p, r in pairs]


def scored_batch(spread: str, prompts: int, samples: int, model_dir: str):
    import pyarrow as pa

    from dapo.algorithm.batch import SCORED_SCHEMA

    rng = random.Random(1)
    rows = []
    shape = lengths(spread, prompts * samples, model_dir)
    for g in range(prompts):
        prompt = [rng.randrange(1, 300) for _ in range(shape[g * samples][0])]
        for i in range(samples):
            n = shape[g * samples + i][1]
            reward = 1.0 if (i + g) % 3 == 0 else -1.0
            rows.append(dict(
                group_id=f"g{g}", prompt_uid=f"p{g}", sample_index=i, prompt="", ground_truth="",
                prompt_token_ids=prompt, response_token_ids=[rng.randrange(1, 300) for _ in range(n)], response_text="",
                rollout_log_probs=[-5.0] * n, truncated=n == MAX_RESPONSE[spread], reward=reward, acc=float(reward > 0),
                score=reward, overlong_penalty=0.0, format_score=0.0, unverified=0.0,
            ))
    return pa.Table.from_pylist(rows, schema=SCORED_SCHEMA)


def worker(args) -> None:
    import torch

    from dapo.config import DAPOConfig
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import policy_update

    torch.set_num_threads(1)
    spread, plan = args.spread, args.plan
    longest = MAX_PROMPT[spread] + MAX_RESPONSE[spread]
    config = DAPOConfig.tiny_cpu().replace(
        trainer_backend="torch", n_samples_per_prompt=args.samples, train_prompt_bsz=args.prompts, gen_prompt_bsz=args.prompts,
        ppo_mini_batch_size=args.mini_batch, max_prompt_length=MAX_PROMPT[spread], max_response_length=MAX_RESPONSE[spread],
        overlong_buffer_len=MAX_RESPONSE[spread] // 4, max_rollout_logprob_gap=math.inf,
        micro_batch_size=args.micro_batch if plan == "fixed" else 0,
        max_tokens_per_micro_batch=0 if plan == "fixed" else args.micro_batch * longest,
        remove_padding=plan in ("packed", "varlen"), attn_implementation="sdpa_varlen" if plan == "varlen" else "sdpa",
    )
    table = scored_batch(spread, args.prompts, args.samples, args.model_dir)
    row_tokens = sum(len(p) + len(r) for p, r in zip(table.column("prompt_token_ids").to_pylist(),
                                                     table.column("response_token_ids").to_pylist()))
    trainer = make_trainer(config, args.model_dir)
    computed = []
    trainer.module.register_forward_pre_hook(lambda _, a, kw: computed.append(kw["input_ids"].numel()), with_kwargs=True)
    before = rss_mib()
    policy_update(trainer, table, config, step=0, temperature=1.0)  # warm-up
    tokens_per_step = sum(computed)
    times = []
    for step in range(1, args.repeats + 1):
        started = time.perf_counter()
        metrics = policy_update(trainer, table, config, step=step, temperature=1.0)
        times.append(time.perf_counter() - started)
    trainer.close()
    print_result({
        "step_s": statistics.median(times), "computed_tokens": tokens_per_step, "widest_forward": max(computed),
        "real_tokens": 2 * row_tokens,  # the log-prob pass and one epoch
        "rss_growth_mib": peak_rss_mib() - before, "grad_norm": metrics["grad_norm"],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spread", default=",".join(SPREADS), help=f"comma-separated, of {SPREADS}")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {PLANS}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--mini-batch", type=int, default=4, help="prompts per update")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows a forward (fixed); the budget is this many longest rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", default="", help="a tiny policy of >= 1,120 positions (built there if absent; default: a temp dir)")
    parser.add_argument("--worker", nargs=2, metavar=("SPREAD", "PLAN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.spread, args.plan = args.worker
        worker(args)
        return
    from dapo import checkpoint
    from dapo.model.policy import TinyPolicySpec, build_tiny_policy

    spreads, plans = chosen(args.spread, SPREADS, "spread"), chosen(args.plans, PLANS, "plan")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or os.path.join(tmp, "policy")
        if not checkpoint.is_complete(model_dir):
            print("building a tiny policy of 2,048 positions ...", flush=True)
            with checkpoint.atomic_dir(model_dir) as scratch:
                build_tiny_policy(scratch, TinyPolicySpec(warm_start_steps=10, max_position_embeddings=2048, task="long_arithmetic"))
        for spread in spreads:
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for plan in plans:  # alternating, so a busy machine's drift falls on every plan alike
                    command = [sys.executable, "-m", "benchmarks.micro_batches", "--worker", spread, plan, "--model-dir", model_dir,
                               "--prompts", str(args.prompts), "--samples", str(args.samples), "--mini-batch", str(args.mini_batch),
                               "--micro-batch", str(args.micro_batch), "--repeats", str(args.repeats)]
                    result = run_worker(command, f"the {spread}/{plan} worker")
                    if plan not in best or result["step_s"] < best[plan]["step_s"]:
                        best[plan] = result
            report(spread, best, args)


def report(spread: str, results: dict[str, dict], args) -> None:
    longest = MAX_PROMPT[spread] + MAX_RESPONSE[spread]
    print(f"\n{spread}: {args.prompts} prompts x {args.samples} responses, mini-batch {args.mini_batch} prompts; "
          f"fixed: {args.micro_batch} rows a forward; budget: {args.micro_batch * longest} tokens; "
          f"best median of {args.repeats} steps over {args.rounds} round(s)")
    print(f"{'plan':<8} {'step s':>8} {'x fixed':>8} {'tokens computed':>16} {'real':>8} {'widest forward':>15} {'RSS growth MiB':>15}")
    base = results.get("fixed")
    for plan, r in results.items():
        speedup = f"{base['step_s'] / r['step_s']:.2f}" if base else "-"
        print(f"{plan:<8} {r['step_s']:>8.3f} {speedup:>8} {r['computed_tokens']:>16,} {r['real_tokens']:>8,} "
              f"{r['widest_forward']:>15,} {r['rss_growth_mib']:>15.0f}")


if __name__ == "__main__":
    main()
