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
    assert DAPOConfig.paper_32b().execution == "colocated" and DAPOConfig.paper_32b().colocated_checkpoint_every == 5
    colocated = DAPOConfig.tiny_cpu().replace(execution="colocated")
    assert colocated.execution == "colocated"
    # both modes compute the same steps: switching keeps the step tasks' cache keys
    assert not hasattr(colocated.step_config(), "execution") and colocated.step_config() == DAPOConfig.tiny_cpu().step_config()
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
    with pytest.raises(ConfigError, match="unknown config field 'clip_hgh'; did you mean algorithm.clip_high"):
        DAPOConfig.from_dict({"clip_hgh": 0.3})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        DAPOConfig.preset("huge")


def test_round_trip_and_overrides():
    c = DAPOConfig.preset("tiny_cpu", {"total_steps": 7, "clip_high": 0.3})
    assert c.total_steps == 7 and c.clip_high == 0.3
    assert DAPOConfig.from_dict(c.to_dict()) == c


def test_resolve_config_is_not_cached_so_an_edited_config_file_is_read_again(tmp_path):
    """Its key would be the file's name, not its content (nor a preset's values after an
    upgrade, nor a user's function's code): the run's config is read afresh every time."""
    from tasks.config import resolve, resolve_config

    assert not resolve_config.metadata.cache
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  clip_high: 0.3\n")
    assert resolve("tiny_cpu", config_file=str(path)).clip_high == 0.3
    path.write_text("algorithm:\n  clip_high: 0.25\n")
    assert resolve("tiny_cpu", config_file=str(path)).clip_high == 0.25


def test_overrides_by_section_dotted_or_flat_give_the_same_config():
    by_section = DAPOConfig.preset("tiny_cpu", {"algorithm": {"clip_high": 0.3}, "rollout": {"temperature": 0.9}})
    dotted = DAPOConfig.preset("tiny_cpu", {"algorithm.clip_high": 0.3, "rollout.temperature": 0.9})
    flat = DAPOConfig.preset("tiny_cpu", {"clip_high": 0.3, "temperature": 0.9})  # the JSON of earlier releases
    assert by_section == dotted == flat and flat.clip_high == 0.3 and flat.temperature == 0.9
    assert DAPOConfig.from_dict(flat.to_dict()) == flat


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm.temperature": 1.0}, "'algorithm.temperature': temperature is in section 'rollout' \\(rollout.temperature\\)"),
    ({"rollout.clip_hihg": 0.2}, "unknown config field 'rollout.clip_hihg'; did you mean algorithm.clip_high"),
    ({"trainer.lr": "fast"}, "trainer.lr='fast': must be float"),
    ({"algorithm.filter_metric": "score"}, "algorithm.filter_metric='score': must be one of \\('acc', 'reward'\\)"),
    ({"trainer.zero_stage": 4}, "trainer.zero_stage=4: must be one of \\(0, 1, 2, 3\\)"),
    ({"model.embedded_warm_start_steps": 1.5}, "model.embedded_warm_start_steps=1.5: must be int"),
    ({"algorithm.rollout_correction": "tis"}, "algorithm.rollout_correction='tis': must be one of \\['none', 'sequence_mask'"),
    ({"algorithm.rollout_correction_threshold": 0.5}, "algorithm.rollout_correction_threshold=0.5: must be >= 1"),
])
def test_a_misplaced_misspelt_or_mistyped_field_is_refused_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DAPOConfig.preset("tiny_cpu", overrides)


def test_set_assignments_read_values_as_yaml_and_apply_after_the_file_and_the_json(tmp_path):
    from dapo.config import parse_assignments
    from tasks.config import resolve

    assert parse_assignments("algorithm.clip_high=0.2 trainer.lr=1e-6 rollout.max_rollout_logprob_gap=null "
                             "algorithm.dynamic_sampling=false 'run.extra={team: rl}' model.model_path='/models/a b'") == {
        "algorithm.clip_high": 0.2, "trainer.lr": "1e-6", "rollout.max_rollout_logprob_gap": None,
        "algorithm.dynamic_sampling": False, "run.extra": {"team": "rl"}, "model.model_path": "/models/a b",
    }
    with pytest.raises(ConfigError, match="expected section.field=value"):
        parse_assignments("algorithm.clip_high")
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: {clip_high: 0.3, clip_low: 0.1}\nrollout.temperature: 0.8\ntotal_steps: 4\n")
    config = resolve("tiny_cpu", overrides_json='{"clip_low": 0.15}', total_steps=6, config_file=str(path), set="algorithm.clip_high=0.25")
    assert (config.clip_high, config.clip_low, config.temperature, config.total_steps) == (0.25, 0.15, 0.8, 6)


def test_a_float_field_takes_inf_and_yaml_11_exponents_from_set_and_files_and_refuses_nan_naming_it(tmp_path):
    from tasks.config import resolve

    config = resolve("tiny_cpu", set="rollout.max_rollout_logprob_gap=inf trainer.lr=1e-6")
    assert (config.max_rollout_logprob_gap, config.lr) == (float("inf"), 1e-6)
    assert config.rollout_gap_threshold == float("inf")
    path = tmp_path / "run.yaml"
    path.write_text("trainer: {lr: 3e-6}\nrollout: {max_rollout_logprob_gap: .inf}\n")
    config = resolve("tiny_cpu", config_file=str(path))
    assert (config.max_rollout_logprob_gap, config.lr) == (float("inf"), 3e-6)
    for value in ("nan", ".nan", "NaN"):
        with pytest.raises(ConfigError, match=r"rollout\.max_rollout_logprob_gap=.*nan is not"):
            resolve("tiny_cpu", set=f"rollout.max_rollout_logprob_gap={value}")
    with pytest.raises(ConfigError, match=r"trainer\.lr='fast': must be float"):
        resolve("tiny_cpu", set="trainer.lr=fast")


def test_every_set_example_in_the_readme_builds_a_config():
    import re
    from pathlib import Path

    from dapo.config import flat_overrides, parse_assignments

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    examples = re.findall(r"--set\s+(?:'([^']*)'|([^\s`'\\]+))", readme)
    assert len(examples) >= 5, examples
    for quoted, bare in examples:  # a ConfigError names the example's field
        DAPOConfig.preset("tiny_cpu", flat_overrides(parse_assignments(quoted or bare)))


def test_every_field_is_in_one_section_has_help_and_the_command_line_lists_it():
    import dataclasses
    import subprocess
    import sys

    from dapo.cli import field_help
    from dapo.config import SECTION_OF, SECTIONS

    assert set(SECTION_OF) == {f.name for f in dataclasses.fields(DAPOConfig)}
    assert sum(len(dataclasses.fields(section)) for section in SECTIONS.values()) == len(SECTION_OF)  # each in one section
    undocumented = [f"{name}.{f.name}" for name, section in SECTIONS.items() for f in dataclasses.fields(section)
                    if not field_help(section).get(f.name)]
    assert not undocumented
    shown = subprocess.run([sys.executable, "-m", "dapo", "config", "--preset", "node_7b"], capture_output=True, text=True, check=True).stdout
    for name, section in SECTIONS.items():
        assert f"[{name}]" in shown
        for f in dataclasses.fields(section):
            assert f"\n  {name}.{f.name}: " in shown
    assert "  rollout.tensor_parallel_size: int = 4\n" in shown  # node_7b's value
    refused = subprocess.run([sys.executable, "-m", "dapo", "config", "--set", "trainer.lr=x"], capture_output=True, text=True)
    assert refused.returncode == 2 and "trainer.lr='x': must be float" in refused.stderr


def test_a_yaml_written_by_the_command_line_reads_back_as_the_same_config(tmp_path):
    import subprocess
    import sys

    from dapo.config import flat_overrides, read_config_file

    text = subprocess.run([sys.executable, "-m", "dapo", "config", "--preset", "paper_32b", "--yaml", "--set", "algorithm.clip_high=0.3"],
                          capture_output=True, text=True, check=True).stdout
    (tmp_path / "run.yaml").write_text(text)
    # as resolve_config reads it (which then also pins the hub model's commit, from the hub)
    read_back = DAPOConfig.preset("tiny_cpu", flat_overrides(read_config_file(str(tmp_path / "run.yaml"))))
    assert read_back == DAPOConfig.paper_32b().replace(clip_high=0.3)


def test_the_step_config_is_a_type_without_the_runs_shape_or_pods():
    from dapo.config import StepConfig

    config = DAPOConfig.paper_32b()
    step = config.step_config()
    assert type(step) is StepConfig and not hasattr(step, "total_steps") and not hasattr(step, "stage_timeout_minutes")
    assert step.clip_ratio_c == 10.0 and step.tensor_parallel_size == 4
    # an extended, re-chunked, re-timed run keeps its step config: every computed step is reused
    longer = config.replace(total_steps=2000, val_every=25, steps_per_chunk=25, chunk_timeout_minutes=3000, task_retries=5)
    assert longer.step_config() == step


@pytest.mark.parametrize("preset", ["one_gpu_1p5b", "node_7b", "paper_32b"])
def test_every_gpu_preset_passes_its_run_budget(preset):
    from dapo.cluster import run_budget

    config = DAPOConfig.preset(preset)  # validation runs the run budget, as timeouts are set
    budgets = run_budget.task_budgets(config)
    assert budgets and all(b.timeout_minutes >= b.needed_minutes for b in budgets), run_budget.budget_lines(config)
