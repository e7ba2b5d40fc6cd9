"""Advantage estimators (dapo/algorithm/advantages.py: group_norm, rloo, dr_grpo) against verl
0.9.1's own core_algos, chosen by name in adv_estimator like losses, and a user's own from a file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dapo.algorithm.advantages import (
    ADVANTAGE_EPS,
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    group_advantages,
    group_index,
    rloo_advantages,
)
from dapo.config import ConfigError, DAPOConfig
from dapo.engines.update import estimate_advantages
from verl_reference import verl_module

SIZES = (1, 2, 3, 5, 8, 16)
"""Group sizes of the random batches: a group of one among them; each batch adds a group of 4 equal rewards."""


def random_groups(seed: int) -> tuple[torch.Tensor, list[str]]:
    """Rewards (float64) and group ids of groups of every size in SIZES plus one of 4 equal
    rewards, rows shuffled so that groups interleave; odd seeds draw DAPO's +-1 rewards."""
    g = torch.Generator().manual_seed(seed)
    rewards, ids = [], []
    for n, size in enumerate(SIZES):
        r = torch.randn(size, generator=g, dtype=torch.float64) * 2 + 0.5
        rewards.append(torch.where(r > 0.5, 1.0, -1.0) if seed % 2 else r)
        ids += [f"uid-{n}"] * size
    rewards.append(torch.full((4,), 0.75, dtype=torch.float64))
    ids += ["uid-equal"] * 4
    order = torch.randperm(len(ids), generator=g)
    return torch.cat(rewards)[order], [ids[i] for i in order]


@pytest.fixture(scope="module")
def core_algos():
    """verl 0.9.1's verl/trainer/ppo/core_algos.py, run from its wheel's own source; the imports
    its advantage estimators do not use are placeholders (omegaconf and the config classes are
    only named in annotations)."""

    def not_used(*args, **kwargs):
        raise AssertionError("not used by the estimators compared")

    return verl_module("verl/trainer/ppo/core_algos.py", {
        "omegaconf": {"DictConfig": type("DictConfig", (), {})},
        "verl.utils": {"as_torch_index": not_used, "group_mean_std": not_used},
        "verl.utils.torch_functional": {},
        "verl.utils.import_utils": {"deprecated": lambda *args, **kwargs: (lambda function: function)},
        "verl.trainer.config": {"AlgoConfig": type("AlgoConfig", (), {})},
        "verl.workers.config": {"ActorConfig": type("ActorConfig", (), {})},
    })


def verl_advantages(core_algos, name: str, rewards: torch.Tensor, ids: list[str]) -> torch.Tensor:
    """verl's per-token advantages for outcome rewards (each on its response's last token, as verl's
    reward managers put it), checked to be one value a response, returned per response."""
    g = torch.Generator().manual_seed(len(ids))
    lengths = torch.randint(1, 12, (len(ids),), generator=g)
    mask = (torch.arange(12) < lengths.unsqueeze(-1)).to(rewards.dtype)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(ids)), lengths - 1] = rewards
    index = np.array(ids, dtype=object)
    if name == "rloo":
        advantages, returns = core_algos.compute_rloo_outcome_advantage(token_rewards, mask, index, epsilon=ADVANTAGE_EPS)
    else:
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            token_rewards, mask, index, epsilon=ADVANTAGE_EPS, norm_adv_by_std_in_grpo=name == "group_norm")
    assert torch.equal(advantages, returns) and torch.equal(advantages, advantages[:, :1] * mask)
    return advantages[:, 0]


@pytest.mark.parametrize("name", ["group_norm", "rloo", "dr_grpo"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_each_estimator_matches_verl_0_9_1_on_every_group_of_two_or_more(core_algos, name, seed):
    """verl's grpo divides by torch.std (unbiased) + epsilon, as group_norm does; ours rounds a
    float64 result to float32, verl here computes in float64 throughout."""
    rewards, ids = random_groups(seed)
    ours = ADVANTAGE_ESTIMATORS[name](rewards, group_index(ids), ADVANTAGE_EPS)
    theirs = verl_advantages(core_algos, name, rewards, ids)
    assert ours.dtype == torch.float32 and ours.shape == (len(ids),)
    grouped = torch.tensor([ids.count(i) > 1 for i in ids])
    assert (ours.double() - theirs)[grouped].abs().max().item() < 1e-6
    assert torch.allclose(ours.double()[grouped], theirs[grouped], rtol=2**-23, atol=1e-12)  # float32's rounding alone
    assert ours[[i == "uid-equal" for i in ids]].tolist() == [0.0] * 4  # equal rewards: no signal in either


@pytest.mark.parametrize("name, verl_singleton", [
    ("group_norm", lambda r: r / (1 + ADVANTAGE_EPS)),  # verl: mean 0, std 1
    ("rloo", lambda r: r),  # verl: no baseline
    ("dr_grpo", lambda r: r),  # verl: mean 0
])
def test_a_group_of_one_gets_advantage_zero_where_verl_keeps_its_reward(core_algos, name, verl_singleton):
    """The one difference from verl, on purpose: a lone response has no group to compare with,
    so ours gives it no signal, as group_advantages always has; verl passes its raw reward on."""
    rewards, ids = random_groups(0)
    alone = torch.tensor([i == "uid-0" for i in ids])
    assert ADVANTAGE_ESTIMATORS[name](rewards, group_index(ids), ADVANTAGE_EPS)[alone].tolist() == [0.0]
    theirs = verl_advantages(core_algos, name, rewards, ids)[alone]
    assert torch.allclose(theirs, verl_singleton(rewards[alone]), rtol=1e-7, atol=0.0) and theirs.item() != 0.0  # std 1 in float32


def test_rloo_is_each_reward_minus_the_mean_of_the_others_and_dr_grpo_minus_the_group_mean():
    rewards = [1.0, -1.0, -1.0, 1.0, 0.5, 3.0, 2.0]
    ids = ["a", "a", "a", "a", "b", "b", "c"]
    assert rloo_advantages(rewards, ids).tolist() == pytest.approx([4 / 3, -4 / 3, -4 / 3, 4 / 3, -2.5, 2.5, 0.0])
    assert dr_grpo_advantages(rewards, ids).tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, -1.25, 1.25, 0.0])
    std_a = torch.tensor([1.0, -1.0, -1.0, 1.0]).std().item()
    assert group_advantages(rewards, ids)[:4].tolist() == pytest.approx([x / (std_a + 1e-6) for x in (1, -1, -1, 1)])


def test_the_default_estimator_is_todays_group_advantages_bit_for_bit():
    rewards, ids = random_groups(5)
    config = DAPOConfig.tiny_cpu()
    assert config.adv_estimator == "group_norm" and ADVANTAGE_ESTIMATORS["group_norm"] is group_advantages
    assert torch.equal(estimate_advantages(config, rewards.tolist(), group_index(ids)), group_advantages(rewards.tolist(), ids))


# --- a user's own --------------------------------------------------------------------------
def estimator_file(tmp_path: Path, body: str, name: str = "advantages.py") -> str:
    path = tmp_path / name
    path.write_text("import torch\n\n\ndef median_baseline(rewards, group_ids, eps):\n" + body)
    return f"{path}:median_baseline"


MEDIAN_BASELINE = (
    "    medians = torch.stack([rewards[group_ids == g].median() for g in range(int(group_ids.max()) + 1)])\n"
    "    return (rewards - medians[group_ids]).float()\n"
)


def test_a_users_estimator_from_a_file_gives_the_steps_advantages(tmp_path, policy_dir):
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import prepare_step
    from policy_steps import make_config, scored_table

    spec = estimator_file(tmp_path, MEDIAN_BASELINE)
    table = scored_table(rewards=[0.0, 1.0, 1.0, 3.0, 5.0, -1.0, 2.0, 2.0] * 2)
    config = make_config(adv_estimator=spec)
    data = prepare_step(make_trainer(config, policy_dir), table, config, temperature=1.0)
    rewards = torch.tensor(table.column("reward").to_pylist())
    medians = torch.tensor([1.0, 2.0, 1.0, 2.0]).repeat_interleave(len(rewards) // 4)  # torch's median: the lower middle
    assert torch.equal(data.advantages, rewards - medians)
    assert data.metrics["advantage_abs_mean"] == pytest.approx((rewards - medians).abs().mean().item())


def test_an_estimator_that_returns_another_shape_is_named(tmp_path):
    spec = estimator_file(tmp_path, "    return rewards[:1].float()\n")
    with pytest.raises(ValueError, match=r"advantage estimator '.*median_baseline' returned shape \(1,\), expected \(3,\)"):
        estimate_advantages(DAPOConfig.tiny_cpu().replace(adv_estimator=spec), [1.0, 0.0, 2.0], group_index(["a", "a", "b"]))


@pytest.mark.parametrize("assignment, message", [
    ("algorithm.adv_estimator=rlooo",
     "DAPOConfig.adv_estimator: unknown advantage estimator 'rlooo': choose one of \\['dr_grpo', 'group_norm', 'rloo'\\]"),
    ("algorithm.adv_estimator=examples/no_such.py:advantages",
     "DAPOConfig.adv_estimator: advantage estimator 'examples/no_such.py:advantages': no file"),
    ("algorithm.adv_estimator=''", "algorithm.adv_estimator='': must name an advantage estimator"),
])
def test_a_misspelt_estimator_fails_when_the_run_starts_naming_its_field_and_the_choices(assignment, message):
    from tasks.config import resolve

    with pytest.raises(ConfigError, match=message):
        resolve("tiny_cpu", set=assignment)


def test_the_step_config_carries_a_digest_of_the_users_estimator_so_cached_steps_follow_its_code(tmp_path):
    from tasks.config import resolve

    spec = estimator_file(tmp_path, MEDIAN_BASELINE)
    first = resolve("tiny_cpu", set=f"algorithm.adv_estimator={spec}").user_code_digest
    assert first and resolve("tiny_cpu", set=f"algorithm.adv_estimator={spec}").user_code_digest == first
    path = Path(spec.rpartition(":")[0])
    path.write_text(path.read_text().replace(".median()", ".min()"))
    assert resolve("tiny_cpu", set=f"algorithm.adv_estimator={spec}").user_code_digest not in ("", first)
