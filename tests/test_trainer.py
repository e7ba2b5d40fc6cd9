"""The DAPO policy step (dapo.engines.update on the dapo.engines.trainer backends): exact accumulation, direction, masking, resume, refusal.

The DeepSpeed tests (marker ``deepspeed``) run one process with DS_ACCELERATOR=cpu;
the first engine of a machine JIT-builds DeepSpeed's comm op (~60 s, cached after).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dapo import checkpoint
from dapo.algorithm.batch import collate, response_log_probs, trim_batch
from dapo.engines.trainer import STATE_DIR, make_trainer, prune_step_dirs
from dapo.engines.update import lr_at, minibatch_backward, policy_update, prepare_step
from policy_steps import G, accumulate, make_config, max_diff, scored_table, weights_of

def sequence_log_probs(trainer, table) -> torch.Tensor:
    batch = collate(table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist(), 0)
    log_probs, _ = trainer.log_probs(batch, temperature=1.0)
    return log_probs.sum(dim=-1)


# --- schedule and helpers ---------------------------------------------------------------
def test_lr_warmup_is_linear_over_policy_steps_then_constant():
    config = make_config(lr=1e-6, warmup_steps=4)
    assert [lr_at(config, s) for s in range(6)] == pytest.approx([0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6, 1e-6])
    assert lr_at(make_config(warmup_steps=0), 0) == pytest.approx(1e-3)


def test_trimmed_forward_matches_padded_forward(policy_dir):
    trainer = make_trainer(make_config(), policy_dir)
    try:
        table = scored_table(groups=2)
        batch = collate(table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist(), 0)
        short = batch.select(torch.tensor([0, 1]))  # shorter than the batch's padded width
        trimmed = trim_batch(short)
        assert trimmed.input_ids.shape[1] < short.input_ids.shape[1]
        with torch.no_grad():
            full, _ = response_log_probs(trainer.model, short)
            ours, _ = trainer.forward(short, temperature=1.0)
        mask = short.response_mask.bool()
        assert ours.shape == full.shape
        assert (ours[mask] - full[mask]).abs().max().item() < 1e-5
    finally:
        trainer.close()


# --- the update's direction -------------------------------------------------------------
def test_update_moves_positive_advantage_responses_up_relative_to_negative_ones(policy_dir):
    # One Adam update is sign-like: it shifts a group's shared context as well, so a single
    # response's absolute direction is not guaranteed on a near-random tiny model. What the
    # objective guarantees (and what is checked, in every group): the advantage-weighted
    # change is positive, and positive-advantage responses gain on the negative ones.
    config = make_config(ppo_mini_batch_size=4, lr=2e-5, warmup_steps=0, weight_decay=0.0, micro_batch_size=5)
    table = scored_table(groups=4, seed=3, split_vocab=True)
    trainer = make_trainer(config, policy_dir)
    try:
        before = sequence_log_probs(trainer, table)
        metrics = policy_update(trainer, table, config, step=0, temperature=1.0)
        after = sequence_log_probs(trainer, table)
    finally:
        trainer.close()
    assert metrics["num_updates"] == 1 and metrics["nonfinite_updates"] == 0
    rewards = torch.tensor(table.column("reward").to_pylist())
    delta = after - before
    assert delta.abs().max() > 1e-3  # the policy moved
    assert (rewards * delta).sum() > 0
    for g in range(4):
        d, r = delta[g * G : (g + 1) * G], rewards[g * G : (g + 1) * G]
        assert d[r > 0].mean() > d[r < 0].mean(), (g, delta)
    assert delta[rewards > 0].mean() > delta[rewards < 0].mean()
    assert metrics["rollout_logprob_diff"] > 0 and math.isfinite(metrics["entropy"])
    assert metrics["tokens"] == sum(len(r) for r in table.column("response_token_ids").to_pylist())


# --- overlong filtering -----------------------------------------------------------------
def test_overlong_filtering_masks_truncated_rows_out_of_the_gradient(policy_dir):
    table = scored_table(groups=2, truncated_every=2)
    truncated = table.column("truncated").to_pylist()
    # Same rows, but the truncated responses' tokens replaced (same lengths, same rewards).
    responses = table.column("response_token_ids").to_pylist()
    altered = [[(t * 7 + 3) % 299 + 1 for t in r] if cut else r for r, cut in zip(responses, truncated)]
    other = table.set_column(table.schema.get_field_index("response_token_ids"), "response_token_ids",
                             pa.array(altered, type=pa.list_(pa.int32())))
    filtered = make_config(overlong_filtering=True)
    unfiltered = make_config(overlong_filtering=False)
    trainer = make_trainer(filtered, policy_dir)
    try:
        result, grads = accumulate(trainer, table, filtered)
        _, grads_other = accumulate(trainer, other, filtered)
        _, grads_raw = accumulate(trainer, table, unfiltered)
        _, grads_raw_other = accumulate(trainer, other, unfiltered)
        metrics = policy_update(trainer, table, filtered, step=0, temperature=1.0)
    finally:
        trainer.close()
    assert any(truncated) and not all(truncated)
    assert max_diff(grads, grads_other) < 1e-7  # truncated tokens do not reach the gradient
    assert max_diff(grads_raw, grads_raw_other) > 1e-4  # ...but they do without filtering
    kept = sum(len(r) for r, cut in zip(responses, truncated) if not cut)
    assert metrics["loss_tokens"] == kept < metrics["tokens"]


# --- non-finite loss ----------------------------------------------------------------------
def run_nonfinite(config, policy_dir):
    rewards = [float("nan")] * G + [1.0, -1.0, 1.0, -1.0]  # group 0's advantages are NaN
    table = scored_table(groups=2, rewards=rewards)
    trainer = make_trainer(config, policy_dir)
    try:
        before = weights_of(trainer)
        all_bad = scored_table(groups=2, rewards=[float("nan")] * (2 * G))
        refused = policy_update(trainer, all_bad, config, step=0, temperature=1.0)
        unchanged = weights_of(trainer)
        partial = policy_update(trainer, table, config.replace(ppo_mini_batch_size=1), step=1, temperature=1.0)
        changed = weights_of(trainer)
    finally:
        trainer.close()
    return before, refused, unchanged, partial, changed


def check_nonfinite(before, refused, unchanged, partial, changed):
    assert refused["nonfinite_updates"] == 1 and refused["num_updates"] == 0
    assert max_diff(before, unchanged) == 0.0
    assert partial["nonfinite_updates"] == 1 and partial["num_updates"] == 1
    assert math.isfinite(partial["pg_loss"]) and math.isfinite(partial["grad_norm"])
    assert max_diff(before, changed) > 0.0


def test_nonfinite_loss_refuses_the_update_torch(policy_dir):
    check_nonfinite(*run_nonfinite(make_config(micro_batch_size=3), policy_dir))


# --- checkpoints and exact resume ---------------------------------------------------------
def two_steps_and_resume(config, policy_dir, tmp_path):
    """(weights after 2 steps in one trainer, after step 0 + save + resume + step 1, metrics, ckpt)."""
    tables = [scored_table(groups=2, seed=10), scored_table(groups=2, seed=11)]
    ckpt = tmp_path / f"{config.trainer_backend}-step0"
    trainer = make_trainer(config, policy_dir)
    try:
        first = policy_update(trainer, tables[0], config, step=0, temperature=1.0)
        trainer.save(ckpt)
        after_first = weights_of(trainer)
        policy_update(trainer, tables[1], config, step=1, temperature=1.0)
        continuous = weights_of(trainer)
    finally:
        trainer.close()
    resumed_trainer = make_trainer(config, ckpt)
    try:
        assert resumed_trainer.resumed and resumed_trainer.state.next_step == 1
        policy_update(resumed_trainer, tables[1], config, step=1, temperature=1.0)
        resumed = weights_of(resumed_trainer)
    finally:
        resumed_trainer.close()
    return continuous, resumed, first, after_first, ckpt, tables


def check_hf_checkpoint(ckpt: Path, expected: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert checkpoint.is_complete(ckpt, verify=True)
    assert checkpoint.read_marker(ckpt)["step"] == 0
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    loaded = {name: p.detach().float() for name, p in model.named_parameters()}
    assert max_diff(loaded, expected) == 0.0
    assert AutoTokenizer.from_pretrained(ckpt).eos_token is not None


def test_torch_backend_resumes_exactly_and_saves_an_hf_checkpoint(policy_dir, tmp_path):
    config = make_config(micro_batch_size=3, ppo_mini_batch_size=1)
    continuous, resumed, _, after_first, ckpt, tables = two_steps_and_resume(config, policy_dir, tmp_path)
    assert max_diff(continuous, resumed) < 1e-6
    check_hf_checkpoint(ckpt, after_first)
    # Control: the same second step without the optimizer state lands elsewhere.
    fresh_dir = tmp_path / "weights-only"
    with checkpoint.atomic_dir(fresh_dir) as scratch:
        for item in ckpt.iterdir():
            if item.is_file() and item.name != checkpoint.COMPLETE_FILE:
                (Path(scratch) / item.name).write_bytes(item.read_bytes())
    trainer = make_trainer(config, fresh_dir)
    try:
        assert not trainer.resumed
        policy_update(trainer, tables[1], config, step=1, temperature=1.0)
        assert max_diff(continuous, weights_of(trainer)) > 1e-5
    finally:
        trainer.close()


def test_optimizer_state_of_another_backend_is_refused(policy_dir, tmp_path):
    ckpt = tmp_path / "deepspeed-ckpt"
    with checkpoint.atomic_dir(ckpt) as scratch:
        for item in Path(policy_dir).iterdir():
            if item.is_file() and item.name != checkpoint.COMPLETE_FILE:
                (Path(scratch) / item.name).write_bytes(item.read_bytes())
        (Path(scratch) / STATE_DIR).mkdir()
        (Path(scratch) / STATE_DIR / "meta.json").write_text('{"backend": "deepspeed", "next_step": 3}')
    with pytest.raises(ValueError, match="not interchangeable"):
        make_trainer(make_config(trainer_backend="torch"), ckpt)


# --- DeepSpeed ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_run(policy_dir, tmp_path_factory):
    """DeepSpeed ZeRO-2 (split micro-batches) against the torch backend (whole mini-batches)."""
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("deepspeed")
    config = make_config(trainer_backend="deepspeed", zero_stage=2, micro_batch_size=3, ppo_mini_batch_size=1)
    continuous, resumed, first, after_first, ckpt, tables = two_steps_and_resume(config, policy_dir, tmp)
    reference = make_config(trainer_backend="torch", micro_batch_size=0, ppo_mini_batch_size=1)
    trainer = make_trainer(reference, policy_dir)
    try:
        torch_first = policy_update(trainer, tables[0], reference, step=0, temperature=1.0)
        torch_after_first = weights_of(trainer)
    finally:
        trainer.close()
    return dict(continuous=continuous, resumed=resumed, first=first, after_first=after_first, ckpt=ckpt,
                torch_first=torch_first, torch_after_first=torch_after_first, config=config)


@pytest.mark.deepspeed
def test_deepspeed_accumulation_is_not_rescaled(deepspeed_run):
    # grad_norm is the pre-clip norm of the accumulated gradient: any 1/GAS or 1/n_micro
    # rescaling by DeepSpeed would show here (Adam itself is nearly scale-invariant).
    ds, ref = deepspeed_run["first"], deepspeed_run["torch_first"]
    assert ds["num_updates"] == ref["num_updates"] == 2
    assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ds["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6)
    assert max_diff(deepspeed_run["after_first"], deepspeed_run["torch_after_first"]) < 1e-5


@pytest.mark.deepspeed
def test_a_lone_deepspeed_process_leaves_no_rendezvous_variables_behind(deepspeed_run):
    """Its 1-rank group's port goes to torch, not into the environment that every process
    started from this one inherits (a later run there would find the port taken)."""
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 1
    assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} & set(os.environ)


@pytest.mark.deepspeed
def test_a_zero3_trainer_without_accelerate_leaves_later_model_loads_working(policy_dir, monkeypatch, caplog):
    """transformers' HfDeepSpeedConfig registers itself globally before it checks for
    accelerate: without accelerate the half-built object stayed registered, and every later
    from_pretrained in the process failed ('HfDeepSpeedConfig' object has no attribute
    'is_zero3'). The trainer falls back to loading the whole model, and leaves nothing behind."""
    import importlib.metadata

    import transformers.integrations.deepspeed as hf_deepspeed
    from transformers import AutoModelForCausalLM

    def no_accelerate(name: str) -> None:
        if name == "accelerate":
            raise importlib.metadata.PackageNotFoundError("accelerate")

    monkeypatch.setattr(hf_deepspeed, "dep_version_check", no_accelerate)
    with caplog.at_level(logging.WARNING, logger="dapo.engines.trainer.deepspeed_backend"):
        trainer = make_trainer(make_config(trainer_backend="deepspeed", zero_stage=3), policy_dir)
    with trainer:
        assert "ZeRO-3 without partitioned loading" in caplog.text  # the fallback was taken
        assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        assert sum(1 for _ in trainer.named_weights()) > 0
    assert AutoModelForCausalLM.from_pretrained(policy_dir).num_parameters() > 0


@pytest.mark.deepspeed
def test_an_hf_engine_started_beside_a_zero3_trainer_holds_the_whole_model(policy_dir, monkeypatch):
    """A ZeRO-3 trainer loads its model partitioned (its DeepSpeed config registered in
    transformers' globals for the load): the rollout engine started while it lives
    (colocated, or the guard's regeneration) still loads every parameter whole, and samples
    as one started alone."""
    pytest.importorskip("accelerate")
    import transformers.modeling_utils as modeling_utils

    from dapo.engines.rollout import SamplingSettings
    from dapo.engines.rollout.hf_engine import HFRolloutEngine

    zero3_seen: list[bool] = []  # what from_pretrained saw while building a model
    zero3_enabled = modeling_utils.is_deepspeed_zero3_enabled
    monkeypatch.setattr(modeling_utils, "is_deepspeed_zero3_enabled", lambda: zero3_seen.append(zero3_enabled()) or zero3_seen[-1])

    sampling = SamplingSettings(n=2, max_tokens=6, temperature=1.0, top_p=1.0, seed=3)
    alone = HFRolloutEngine(policy_dir)
    expected = [c.token_ids for c in alone.generate(["1+1="], sampling)]
    alone.close()
    zero3_seen.clear()
    with make_trainer(make_config(trainer_backend="deepspeed", zero_stage=3), policy_dir):
        assert any(zero3_seen)  # the trainer's model was loaded partitioned
        zero3_seen.clear()
        beside = HFRolloutEngine(policy_dir)
        assert not any(zero3_seen)  # the engine's was not
        assert all(p.numel() > 0 for p in beside.model.parameters())
        assert [c.token_ids for c in beside.generate(["1+1="], sampling)] == expected
        beside.close()


@pytest.mark.deepspeed
def test_deepspeed_micro_gradients_equal_the_whole_batch(policy_dir):
    safe_get_full_grad = pytest.importorskip("deepspeed.utils").safe_get_full_grad

    table = scored_table(groups=2, truncated_every=3)
    config = make_config(trainer_backend="deepspeed", micro_batch_size=3, overlong_filtering=True)
    reference = make_trainer(config.replace(trainer_backend="torch", micro_batch_size=0), policy_dir)
    try:
        _, expected = accumulate(reference, table, reference.config)
    finally:
        reference.close()
    trainer = make_trainer(config, policy_dir)
    try:
        data = prepare_step(trainer, table, config, temperature=1.0)
        minibatch_backward(trainer, data, torch.arange(table.num_rows), config, temperature=1.0)
        grads = {name: safe_get_full_grad(p).detach().clone() for name, p in trainer.engine.module.named_parameters()}
        trainer.step()
    finally:
        trainer.close()
    assert max_diff(grads, expected) < 1e-5


@pytest.mark.deepspeed
def test_deepspeed_zero2_resumes_exactly(deepspeed_run):
    assert max_diff(deepspeed_run["continuous"], deepspeed_run["resumed"]) < 1e-6
    state = deepspeed_run["ckpt"] / STATE_DIR / "deepspeed" / "state"
    assert any(p.name.endswith("optim_states.pt") for p in state.iterdir())


@pytest.mark.deepspeed
def test_deepspeed_checkpoint_loads_with_transformers(deepspeed_run):
    check_hf_checkpoint(deepspeed_run["ckpt"], deepspeed_run["after_first"])


@pytest.mark.deepspeed
def test_deepspeed_nonfinite_loss_refuses_the_update(policy_dir):
    pytest.importorskip("deepspeed")
    check_nonfinite(*run_nonfinite(make_config(trainer_backend="deepspeed", micro_batch_size=3), policy_dir))


def test_prune_step_dirs_keeps_the_newest_steps_of_the_run(tmp_path):
    import os

    for name, mtime in (("policy-2-aa", 1), ("policy-10-bb", 2), ("policy-3-cc", 3), ("policy-10-dd", 4), ("other", 0)):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (mtime, mtime))
    removed = prune_step_dirs(tmp_path, keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["policy-2-aa", "policy-3-cc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "policy-10-bb", "policy-10-dd"]
    assert prune_step_dirs(tmp_path / "missing", keep=1) == []


def test_zero3_sync_gathers_parameters_in_buckets_of_their_whole_size():
    """One all-gather per bucket of about SYNC_BUCKET_BYTES, not one per parameter; a ZeRO-3
    parameter's local tensor is a shard, its whole size ds_numel."""
    from dapo.engines.trainer.deepspeed_backend import parameter_buckets

    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 10, 30, 5, 40, 1])]
    params[3][1].ds_numel = 25  # a shard of 5 elements of a 25-element parameter
    buckets = [[name for name, _ in bucket] for bucket in parameter_buckets(params, bucket_bytes=4 * 30)]
    assert buckets == [["p0", "p1"], ["p2"], ["p3"], ["p4"], ["p5"]]  # 40 + 25 > 30, a 40 alone
    assert [n for b in parameter_buckets(params, bucket_bytes=2**30) for n, _ in b] == [n for n, _ in params]


class PlantedPayload:
    """What an attacker with write access to the object store could put in a state file."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PLANTED_MARKER']}",))


@pytest.mark.deepspeed
def test_a_planted_pickle_in_the_optimizer_state_is_refused_naming_the_file_and_never_runs(deepspeed_run, tmp_path, monkeypatch):
    from dapo.engines.trainer.deepspeed_backend import CheckpointRefused

    planted = tmp_path / "planted"
    shutil.copytree(deepspeed_run["ckpt"], planted)
    optim = next((planted / STATE_DIR).rglob("*optim_states.pt"))
    state = torch.load(optim, weights_only=False)  # ours, as DeepSpeed wrote it
    monkeypatch.setenv("PLANTED_MARKER", str(tmp_path / "it-ran"))
    torch.save({**state, "extra": PlantedPayload()}, optim)
    with pytest.raises(CheckpointRefused, match=f"{optim}: refused to load"):
        make_trainer(deepspeed_run["config"], planted)
    assert not (tmp_path / "it-ran").exists()


@pytest.mark.deepspeed
@pytest.mark.parametrize("zero_stage, dtype", [(1, "float32"), (3, "float32"), (2, "bfloat16")])
def test_deepspeeds_state_of_every_zero_stage_loads_with_weights_only(policy_dir, tmp_path, zero_stage, dtype):
    config = make_config(trainer_backend="deepspeed", zero_stage=zero_stage, dtype=dtype)
    with make_trainer(config, policy_dir) as trainer:
        trainer.save(str(tmp_path / "ckpt"))
    with make_trainer(config, str(tmp_path / "ckpt")) as resumed:
        assert resumed.resumed
