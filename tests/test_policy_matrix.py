"""The whole local `dapo_loop`, 2 steps, on the policy layouts users bring: the
common small model (tied embeddings, bf16 on CPU) and an untied fp32 control, each with a
ChatML tokenizer with its own chat template and eos (<|im_end|>), and a tied Llama with a real
model's tokenizer and template (SmolLM2's 49k ChatML), model_path given as a local Hugging Face directory. (The tied fp32 reload is checked to the last bit in-process,
tests/test_weight_sync.py.)

Both runs share one subprocess (tests/run_policy_matrix.py: a fresh Flyte cache under
HOME, one vLLM import, one DeepSpeed JIT build). Step 2 samples from the step-1
checkpoint reloaded into the live engine in place, so a tied policy that the reload got
wrong would show here as a guard regeneration (and, before the fix, as a 0.3+ nat gap).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from machine_caches import machine_caches

REPO = Path(__file__).resolve().parent.parent
MATRIX = ["untied:float32", "tied:bfloat16", "llama-real:float32"]
EXPECTED_GAP = {"float32": 1e-5, "bfloat16": 0.05}  # measured: fp32 3-4e-7, bf16 0.006-0.007

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    work = tmp_path_factory.mktemp("policy_matrix")
    (work / "home").mkdir()
    env = {
        **os.environ,
        "HOME": str(work / "home"),
        **machine_caches(),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DAPO_CRASH_AT", None)
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "run_policy_matrix.py"), str(work), *MATRIX],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, start_new_session=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    runs = [json.loads(line[len("MATRIX "):]) for line in result.stdout.splitlines() if line.startswith("MATRIX ")]
    return work, {f"{r['policy']}:{r['dtype']}": r for r in runs}


@pytest.mark.parametrize("entry", MATRIX)
def test_two_steps_train_on_matching_rollouts(matrix, entry):
    _, runs = matrix
    dtype = entry.split(":")[1]
    steps = [h for h in runs[entry]["history"] if "guard/threshold" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["step/skipped"] == 0.0 and h["actor/num_updates"] >= 1
        assert h["guard/regenerated"] == 0.0 and h["guard/stopped"] == 0.0
        assert h["guard/rollout_logprob_gap"] == h["actor/rollout_logprob_diff"] < EXPECTED_GAP[dtype]
        assert h["guard/threshold"] == {"float32": 1e-3, "bfloat16": 0.1}[dtype]
    assert any(h["train/truncated_frac"] < 1.0 for h in steps), "the ChatML eos (<|im_end|>) ends some samples"


def test_mlflow_gets_the_guard_metrics(matrix):
    from mlflow.tracking import MlflowClient

    work, runs = matrix
    assert sorted(runs) == sorted(MATRIX)
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    logged = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])
    assert len(logged) == len(MATRIX)
    for run in logged:
        assert {"guard/rollout_logprob_gap", "guard/threshold", "guard/regenerated", "guard/stopped"} <= set(run.data.metrics)
        assert run.data.params["model_path"].endswith(("untied-chatml", "tied-chatml", "llama-tied-real"))
