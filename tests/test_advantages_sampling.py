"""Group advantages and the dynamic-sampling filter."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.algorithm.advantages import group_advantages
from dapo.algorithm.sampling import SamplingState, informative_groups


def test_group_advantages_hand_computed():
    rewards = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    groups = ["a", "a", "a", "a", "b", "b"]
    adv = group_advantages(rewards, groups)
    std_a = torch.tensor([1.0, -1.0, -1.0, 1.0]).std().item()  # unbiased: sqrt(4/3)
    assert adv[:4].tolist() == pytest.approx([1 / (std_a + 1e-6), -1 / (std_a + 1e-6)] * 1 + [-1 / (std_a + 1e-6), 1 / (std_a + 1e-6)], abs=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0]  # uniform group: no signal


def test_single_response_group_gets_zero():
    adv = group_advantages([3.0, 1.0, 2.0], ["x", "y", "y"])
    assert adv[0].item() == 0.0
    assert adv[1].item() < 0 < adv[2].item()


def test_group_order_does_not_matter():
    rewards = torch.tensor([0.5, 1.0, -1.0, 2.0, 0.0, 0.0])
    groups = [1, 2, 1, 2, 1, 2]
    adv = group_advantages(rewards, groups)
    perm = torch.tensor([5, 3, 1, 0, 4, 2])
    adv_perm = group_advantages(rewards[perm], [groups[i] for i in perm])
    assert torch.allclose(adv[perm], adv_perm, atol=1e-6)


def test_mismatched_lengths_are_named():
    with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
        group_advantages([1.0, 2.0, 3.0], ["a", "a"])


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 6),
    size=st.integers(2, 8),
    seed=st.integers(0, 10_000),
)
def test_matches_torch_std_reference(groups, size, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * size, generator=g)
    ids = [i % groups for i in range(groups * size)]
    adv = group_advantages(rewards, ids)
    for gid in range(groups):
        members = torch.tensor([i for i, x in enumerate(ids) if x == gid])
        r = rewards[members].double()  # the reference in float64, as group_advantages computes
        expected = ((r - r.mean()) / (r.std() + 1e-6)).float()
        assert torch.allclose(adv[members], expected, atol=1e-5)
        assert abs(adv[members].sum().item()) < 1e-4  # zero-mean within a group


def test_informative_groups_keeps_mixed_only():
    rewards = [1, 1, 1, -1, -1, -1, 1, -1, 0.5, 0.5]
    ids = ["g1", "g1", "g2", "g2", "g3", "g3", "g4", "g4", "g5", "g5"]
    assert informative_groups(rewards, ids) == ["g2", "g4"]
    assert informative_groups([], []) == []


def test_sampling_state_fills_over_rounds_and_reports():
    state = SamplingState().after_round(2, 1, target_groups=3, max_rounds=5, rollout_tokens=10, rollout_seconds=1)
    assert (state.rounds, state.kept_groups, state.done) == (1, 1, False)
    state = state.after_round(3, 3, target_groups=3, max_rounds=5, rollout_tokens=10, rollout_seconds=1)
    assert state == SamplingState(rounds=2, generated_groups=5, kept_groups=4, done=True, rollout_tokens=20, rollout_seconds=2)
    assert state.kept_ratio == pytest.approx(4 / 5)
    assert SamplingState.from_json(state.to_json()) == state


def test_sampling_state_stops_at_round_limit_short():
    state = SamplingState()
    for _ in range(2):
        assert not state.done
        state = state.after_round(1, 0, target_groups=4, max_rounds=2)
    assert state.done and state.kept_groups == 0 and state.kept_ratio == 0.0


def test_sampling_state_unbounded_rounds():
    state = SamplingState()
    for _ in range(50):
        state = state.after_round(1, 0, target_groups=1, max_rounds=0)
    assert not state.done and state.rounds == 50
