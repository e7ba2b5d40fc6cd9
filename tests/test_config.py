"""DAPOConfig: paper defaults, presets and validation messages."""

import pytest

from dapo.config import ConfigError, DAPOConfig


def test_defaults_are_the_papers():
    c = DAPOConfig()
    assert (c.clip_low, c.clip_high) == (0.2, 0.28)
    assert c.loss_agg_mode == "token-mean"
    assert (c.max_response_length, c.overlong_buffer_len, c.overlong_penalty_factor) == (20480, 4096, 1.0)
    assert (c.n_samples_per_prompt, c.train_prompt_bsz, c.gen_prompt_bsz) == (16, 512, 1536)
    assert c.updates_per_step == 16
    assert (c.lr, c.weight_decay, c.grad_clip) == (1e-6, 0.1, 1.0)
    assert (c.val_temperature, c.val_top_p) == (1.0, 0.7)


def test_paper_preset_has_no_format_reward_and_tiny_is_small():
    paper = DAPOConfig.paper_32b()
    assert paper.format_reward_weight == 0.0
    assert (paper.zero_stage, paper.tensor_parallel_size, paper.clip_ratio_c) == (3, 4, 10.0)
    tiny = DAPOConfig.tiny_cpu()
    assert tiny.dtype == "float32" and tiny.max_response_length < 100


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("clip_low", 1.2, "clip_low=1.2: eps_low must lie in \\(0, 1\\)"),
        ("clip_low", 0.0, "clip_low"),
        ("clip_high", -0.1, "clip_high"),
        ("overlong_buffer_len", 30000, "overlong_buffer_len=30000: L_cache"),
        ("n_samples_per_prompt", 1, "n_samples_per_prompt=1: G must be >= 2"),
        ("loss_agg_mode", "sum", "loss_agg_mode='sum'"),
        ("gen_prompt_bsz", 10, "gen_prompt_bsz=10: must be >= train_prompt_bsz"),
        ("clip_ratio_c", 0.5, "clip_ratio_c"),
        ("rollout_backend", "sglang", "rollout_backend"),
        ("top_p", 0.0, "top_p"),
        ("rollout_shards", 0, "rollout_shards=0: must lie in \\[1, prompts per round=1536\\]"),
        ("rollout_shards", 1537, "rollout_shards=1537"),
        ("trainer_nnodes", 0, "trainer_nnodes=0: must be >= 1"),
        ("trainer_nproc_per_node", 0, "trainer_nproc_per_node=0: must be >= 1"),
        ("trainer_nnodes", 2, "trainer_shared_dir='': must name a directory all 2 training nodes mount"),
        ("execution", "hybrid", "execution='hybrid': must be one of \\('per_stage', 'colocated'\\)"),
        ("colocated_checkpoint_every", 0, "colocated_checkpoint_every=0: must be >= 1"),
    ],
)
def test_invalid_values_are_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DAPOConfig().replace(**{field: value})


def test_scale_out_knobs():
    paper = DAPOConfig.paper_32b()
    assert (paper.rollout_shards, paper.trainer_nnodes, paper.trainer_nproc_per_node, paper.trainer_world_size) == (32, 16, 8, 128)
    assert paper.rollout_shards * paper.tensor_parallel_size == paper.trainer_world_size  # rollout and training take turns on 128 GPUs
    tiny = DAPOConfig.tiny_cpu()
    assert (tiny.rollout_shards, tiny.trainer_world_size) == (1, 1)
    with pytest.raises(ConfigError, match="trainer_backend='torch': must be 'deepspeed' for 2 training processes"):
        tiny.replace(trainer_backend="torch", trainer_nproc_per_node=2)
    # without dynamic sampling a round has train_prompt_bsz prompts
    assert tiny.replace(dynamic_sampling=False).prompts_per_round == tiny.train_prompt_bsz
    with pytest.raises(ConfigError, match="prompts per round=16"):
        tiny.replace(dynamic_sampling=False, rollout_shards=17)


def test_execution_mode_defaults_and_is_no_part_of_the_step_config():
    assert DAPOConfig().execution == DAPOConfig.tiny_cpu().execution == "per_stage"
    assert DAPOConfig.paper_32b().execution == "colocated" and DAPOConfig.paper_32b().colocated_checkpoint_every == 10
    colocated = DAPOConfig.tiny_cpu().replace(execution="colocated")
    assert colocated.execution == "colocated"
    # both modes compute the same steps: switching keeps the step tasks' cache keys
    assert "execution" not in colocated.step_dict() and colocated.step_config() == DAPOConfig.tiny_cpu().step_config()
    # over several ranks: 32 engines of 4 GPUs on 16 x 8 trainer GPUs, one rollout shard each
    assert DAPOConfig.paper_32b().replace(execution="colocated").rollout_groups == 32
    with pytest.raises(ConfigError, match="rollout_shards=20: must be a multiple of the 32 vLLM engines"):
        DAPOConfig.paper_32b().replace(execution="colocated", rollout_shards=20)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3: must divide trainer_nproc_per_node=8"):
        DAPOConfig.paper_32b().replace(execution="colocated", tensor_parallel_size=3, rollout_shards=40)
    with pytest.raises(ConfigError, match="rollout_backend='hf': must be 'vllm' with tensor_parallel_size > 1"):
        DAPOConfig.paper_32b().replace(execution="colocated", rollout_backend="hf")
    with pytest.raises(ConfigError, match="colocated_rollout_gpu_memory=1.0: must lie in"):
        DAPOConfig.tiny_cpu().replace(colocated_rollout_gpu_memory=1.0)


def test_unknown_fields_and_presets_are_refused():
    with pytest.raises(ConfigError, match="unknown DAPOConfig field\\(s\\): clip_hgh"):
        DAPOConfig.from_dict({"clip_hgh": 0.3})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        DAPOConfig.preset("huge")


def test_round_trip_and_overrides():
    c = DAPOConfig.preset("tiny_cpu", {"total_steps": 7, "clip_high": 0.3})
    assert c.total_steps == 7 and c.clip_high == 0.3
    assert DAPOConfig.from_dict(c.to_dict()) == c


def test_a_preset_changed_in_code_changes_the_cache_version_of_its_resolution(monkeypatch):
    """resolve_config is cached on the preset's name: were its version blind to the presets'
    values, a run after an upgrade that changed tiny_cpu would get the old tiny_cpu from the
    cache, its new fields at their defaults."""
    from tasks import common

    before = DAPOConfig.presets_fingerprint()
    assert common.CACHE_VERSIONS["resolve_config"].endswith(before)
    tiny = DAPOConfig.tiny_cpu
    monkeypatch.setattr(DAPOConfig, "tiny_cpu", classmethod(lambda cls: tiny().replace(max_tokens_per_micro_batch=8192)))
    assert DAPOConfig.preset("tiny_cpu").max_tokens_per_micro_batch == 8192
    assert DAPOConfig.presets_fingerprint() != before
