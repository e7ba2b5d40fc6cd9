"""Micro-batches: how the rows of a mini-batch (or of the log-prob pass) become forward passes.

A forward pass over a padded micro-batch costs its rows x its width (the longest prompt plus
the longest response among them, prompt padding trimmed): with DAPO's responses spanning
~100 to ~20,000 tokens, a micro-batch of fixed row count pays for its longest row on every
row. Two plans:

- by count (``micro_batch_size`` rows, in the mini-batch's order): the classic layout;
- by a token budget (``max_tokens_per_micro_batch``, as verl's ``ppo_max_token_len_per_gpu``
  and slime/AReaL's ``max_tokens_per_mb``): rows sorted by length fill micro-batches up to
  the budget, so every micro-batch holds rows of similar length and none exceeds the
  budget's cost, whatever the lengths; micro-batches are then dealt to the data-parallel
  ranks by cost (longest first, to the least-loaded rank), so that no rank waits for another.

The cost of a micro-batch is what its forward pass computes over: rows x width when padded,
the sum of the rows' tokens when packed (``remove_padding``: ``dapo.algorithm.batch.pack``).
Which rows share a micro-batch never changes the loss: each micro loss is weighted by its
share of the mini-batch (``dapo.engines.update.minibatch_backward``).
"""

from __future__ import annotations

import torch

from dapo.algorithm.batch import PolicyBatch


def micro_batch_cost(prompt_lengths: list[int], response_lengths: list[int], packed: bool) -> int:
    """Tokens one forward pass over these rows computes: rows x (longest prompt + longest
    response) padded, the rows' own tokens packed."""
    if packed:
        return sum(prompt_lengths) + sum(response_lengths)
    return len(prompt_lengths) * (max(prompt_lengths) + max(response_lengths))


def by_count(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive micro-batches of `size` rows (0: one micro-batch of all)."""
    return list(rows.split(size or len(rows)))


def by_token_budget(
    rows: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, budget: int, packed: bool
) -> list[torch.Tensor]:
    """Rows sorted by length (longest first, ties in row order) fill each micro-batch while
    its cost stays within `budget`; a row costlier than the budget alone gets a micro-batch
    of its own (config validation keeps that from happening: budget >= the longest row)."""
    prompt = prompt_lengths[rows].tolist()
    response = response_lengths[rows].tolist()
    order = sorted(range(len(rows)), key=lambda k: (-(prompt[k] + response[k]), k))
    plans: list[list[int]] = []
    current: list[int] = []
    for k in order:
        candidate = current + [k]
        if (
            current
            and micro_batch_cost([prompt[j] for j in candidate], [response[j] for j in candidate], packed) > budget
        ):
            plans.append(current)
            candidate = [k]
        current = candidate
    if current:
        plans.append(current)
    return [rows[torch.tensor(plan)] for plan in plans]


def deal_to_ranks(costs: list[int], world_size: int, balanced: bool) -> list[list[int]]:
    """Indices of the micro-batches each rank runs. balanced: the costliest first, each to the
    rank with the least cost so far (ties to the lower rank); else round-robin."""
    if not balanced:
        return [list(range(rank, len(costs), world_size)) for rank in range(world_size)]
    loads = [0] * world_size
    dealt: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += costs[index]
        dealt[rank].append(index)
    return [sorted(indices) for indices in dealt]


def plan_micro_batches(
    batch: PolicyBatch,
    rows: torch.Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int,
    packed: bool,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[list[torch.Tensor], int]:
    """(this rank's micro-batches of `rows`, the most any rank runs).

    By token budget when max_tokens > 0, else by count. Every rank computes the same plan
    from the same table; a rank with fewer micro-batches than the most must run fillers so
    that all ranks run the same collectives.
    """
    prompt, response = batch.row_lengths()
    if max_tokens > 0:
        micro = by_token_budget(rows, prompt, response, max_tokens, packed)
    else:
        micro = by_count(rows, micro_batch_size)
    costs = [micro_batch_cost(prompt[m].tolist(), response[m].tolist(), packed) for m in micro]
    dealt = deal_to_ranks(costs, world_size, balanced=max_tokens > 0)
    return [micro[i] for i in dealt[rank]], max(len(indices) for indices in dealt)
