"""The rollout engine's log-probs against transformers', before and after an in-place reload.

For each policy layout (untied / tied embeddings) and dtype: start the vLLM engine on a
generated policy A, sample, and compare the sampled tokens' log-probs with those
transformers computes in the same dtype (what the trainer does: DeepSpeed loads the
policy in the training dtype); then reload a perturbed checkpoint B in place and
compare against B; then (with --fresh) start a fresh engine on B and compare again.
Prints one JSON line per (layout, dtype) with max and mean |gap| for each phase; the
mean is what the pipeline logs as actor/rollout_logprob_diff and the guard checks.

    PYTHONPATH=. python benchmarks/reload_gap.py --dtypes float32 bfloat16 --fresh
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo.model.policy_matrix import PolicyLayout, build_policy, perturbed_copy  # noqa: E402

PROMPTS = ["What is 3 + 4?", "Compute 12 * 3.", "What is 7 - 9?", "Add 5 and 8."]


def rendered_prompts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]


def reference_gap(model_dir: str, dtype: str, completions, device: str) -> tuple[float, float]:
    """max and mean |vLLM - transformers| over all sampled tokens (temperature 1)."""
    from transformers import AutoModelForCausalLM

    from dapo.algorithm.batch import collate, response_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    batch = collate([c.prompt_token_ids for c in completions], [c.token_ids for c in completions], model.config.pad_token_id or 0)
    batch = type(batch)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch, temperature=1.0)
    gaps = torch.cat([(log_probs[i, : len(c.token_ids)].float().cpu() - torch.tensor(c.log_probs)).abs() for i, c in enumerate(completions)])
    return gaps.max().item(), gaps.mean().item()


def measure(layout: PolicyLayout, dtype: str, work: Path, fresh: bool, n: int = 8, max_tokens: int = 24, **engine_options) -> dict:
    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = build_policy(work / f"{layout.name}-a", layout)
    b = perturbed_copy(a, work / f"{layout.name}-b")
    sampling = SamplingSettings(n=n, max_tokens=max_tokens, seed=1)
    row = {"layout": layout.name, "tied": layout.tied, "dtype": dtype, "device": device}
    settings = EngineSettings(dtype=dtype, max_model_len=256, seed=0)
    engine = make_rollout_engine("vllm", a, settings, **engine_options)
    try:
        prompts = rendered_prompts(engine.tokenizer)
        row["before_max"], row["before_mean"] = reference_gap(a, dtype, engine.generate(prompts, sampling), device)
        started = time.perf_counter()
        engine.load_weights(b)
        row["reload_seconds"] = time.perf_counter() - started
        row["reload_mode"] = getattr(engine, "last_reload_mode", "")
        row["after_max"], row["after_mean"] = reference_gap(b, dtype, engine.generate(prompts, sampling), device)
    finally:
        engine.close()
    if fresh:
        engine = make_rollout_engine("vllm", b, settings, **engine_options)
        try:
            row["fresh_max"], row["fresh_mean"] = reference_gap(b, dtype, engine.generate(prompts, sampling), device)
        finally:
            engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--layouts", nargs="+", default=["untied", "tied"], choices=["untied", "tied"])
    parser.add_argument("--fresh", action="store_true", help="also start a fresh engine on the new checkpoint")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        for dtype in args.dtypes:
            for name in args.layouts:
                layout = PolicyLayout(tied=name == "tied", hidden_size=args.hidden_size, num_hidden_layers=args.layers)
                print(json.dumps(measure(layout, dtype, Path(work) / dtype, args.fresh)), flush=True)


if __name__ == "__main__":
    main()
