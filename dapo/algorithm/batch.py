"""Rollout batches: the columns that move between steps, and their tensor form.

Between pipeline steps a batch is a pyarrow Table with ROLLOUT_SCHEMA (one row per
sampled response); verify_rewards adds REWARD_FIELDS. For the policy update the
rows become padded tensors in verl's layout: prompts left-padded to a common
length P, responses right-padded to R, so the logits at positions P-1 .. P+R-2
predict the response tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pyarrow as pa
import torch

from dapo.algorithm.loss import entropy_from_logits

ROLLOUT_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("prompt_uid", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt", pa.string()),
        ("ground_truth", pa.string()),
        ("data_source", pa.string()),  # chooses the row's scorer (DAPOConfig.reward_fn_by_source)
        ("extra_info", pa.string()),  # the data row's extra_info as JSON, for the scorer
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_text", pa.string()),
        ("rollout_log_probs", pa.list_(pa.float32())),
        ("truncated", pa.bool_()),
    ]
)
REWARD_FIELDS = [
    pa.field("reward", pa.float32()),
    pa.field("acc", pa.float32()),
    pa.field("score", pa.float32()),  # R_task, the scorer's (rewards.task_score)
    pa.field("overlong_penalty", pa.float32()),
    pa.field("format_score", pa.float32()),
    pa.field("unverified", pa.float32()),  # 1: the scorer (math-verify) gave no verdict (rewards.TaskScore)
    pa.field("verdict_note", pa.string()),  # why there is no verdict ("" when there is one)
    pa.field("score_metrics", pa.map_(pa.string(), pa.float32())),  # the scorer's own metrics
]
SCORED_SCHEMA = pa.schema(list(ROLLOUT_SCHEMA) + REWARD_FIELDS)


@dataclass
class PolicyBatch:
    """Padded tensors for one set of responses."""

    input_ids: torch.Tensor  # (B, P+R)
    attention_mask: torch.Tensor  # (B, P+R)
    position_ids: torch.Tensor  # (B, P+R)
    responses: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) 1 on real response tokens
    prompt_length: int  # P

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def row_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt tokens, response tokens) of each row, padding excluded."""
        return self.attention_mask[:, : self.prompt_length].sum(dim=-1), self.response_mask.sum(dim=-1)

    def select(self, index: torch.Tensor | slice) -> PolicyBatch:
        return PolicyBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index],
            responses=self.responses[index],
            response_mask=self.response_mask[index],
            prompt_length=self.prompt_length,
        )


def collate(
    prompt_token_ids: list[list[int]],
    response_token_ids: list[list[int]],
    pad_token_id: int,
) -> PolicyBatch:
    """Left-pad prompts, right-pad responses, and build masks and positions."""
    if len(prompt_token_ids) != len(response_token_ids):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(response_token_ids)} responses")
    if not prompt_token_ids:
        raise ValueError("cannot collate an empty batch")
    prompt_len = max(len(p) for p in prompt_token_ids)
    response_len = max(1, max(len(r) for r in response_token_ids))
    batch = len(prompt_token_ids)
    input_ids = torch.full((batch, prompt_len + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(zip(prompt_token_ids, response_token_ids)):
        start = prompt_len - len(prompt)
        input_ids[row, start:prompt_len] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[row, prompt_len : prompt_len + len(response)] = torch.as_tensor(response, dtype=torch.long)
        attention_mask[row, start : prompt_len + len(response)] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, prompt_len:],
        response_mask=attention_mask[:, prompt_len:],
        prompt_length=prompt_len,
    )


def trim_batch(batch: PolicyBatch) -> PolicyBatch:
    """Drop prompt columns that are padding in every row and response columns past the longest response."""
    prompt_len = batch.prompt_length
    prompt_cols = batch.attention_mask[:, :prompt_len].any(dim=0).nonzero()
    left = int(prompt_cols[0]) if len(prompt_cols) else prompt_len - 1
    left = min(left, prompt_len - 1)  # keep the position whose logits predict the first response token
    response_cols = batch.response_mask.any(dim=0).nonzero()
    keep = int(response_cols[-1]) + 1 if len(response_cols) else 1
    end = prompt_len + keep
    input_ids = batch.input_ids[:, left:end]
    new_prompt_len = prompt_len - left
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=batch.attention_mask[:, left:end],
        position_ids=batch.position_ids[:, left:end],
        responses=input_ids[:, new_prompt_len:],
        response_mask=batch.response_mask[:, :keep],
        prompt_length=new_prompt_len,
    )


def collate_table(table: pa.Table, pad_token_id: int) -> PolicyBatch:
    return collate(
        table.column("prompt_token_ids").to_pylist(),
        table.column("response_token_ids").to_pylist(),
        pad_token_id,
    )


def response_log_probs(
    model: torch.nn.Module,
    batch: PolicyBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) of every response token, and optionally the entropy there.

    Logits are divided by the sampling temperature so the log-probs are those of the
    distribution the rollout sampled from.
    """
    width = batch.responses.shape[1]
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        **logits_only_at(model, width + 1),  # positions P-1 .. P+R-1: the last R + 1
    ).logits
    response_logits = logits[:, -(width + 1) : -1, :].float() / temperature
    return _token_log_probs(response_logits, batch.responses, with_entropy)


def logits_only_at(model: torch.nn.Module, keep: int | torch.Tensor) -> dict:
    """The forward's `logits_to_keep` (the last `keep` positions, or these positions), where
    the model takes it: the LM head and its (tokens x vocabulary) logits then cover the
    response only, not the prompt (at SmolLM2's 49k vocabulary, 0.2 MB a token in float32).
    A model whose forward does not take it computes every position's logits, and the caller
    slices them: the same log-probs."""
    forward = getattr(model, "module", model).forward  # a DeepSpeed engine wraps the model
    return {"logits_to_keep": keep} if "logits_to_keep" in _parameters(forward) else {}


def _parameters(function) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    log_probs = torch.log_softmax(logits, dim=-1)
    token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return token_log_probs, entropy_from_logits(logits) if with_entropy else None


@dataclass
class PackedBatch:
    """The rows of a PolicyBatch end to end in one sequence, without padding.

    Positions restart at 0 on each row, which is how transformers recognises packed
    sequences when no attention mask is given: each token attends to its own row only
    (varlen kernels under flash attention, a block-diagonal mask under sdpa and eager).
    """

    input_ids: torch.Tensor  # (1, T), T = the rows' prompt + response tokens
    position_ids: torch.Tensor  # (1, T)
    logit_positions: torch.Tensor  # (N,) where the logits of the N response tokens are
    targets: torch.Tensor  # (N,) the response tokens
    slots: torch.Tensor  # (N,) their flat index in the (rows, width) response layout
    rows: int
    width: int


def pack(batch: PolicyBatch) -> PackedBatch:
    """Each row's real tokens (its prompt, then its response), one row after another."""
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    row_logit_positions: list[torch.Tensor] = []
    row_slots: list[torch.Tensor] = []
    width = batch.responses.shape[1]
    offset = 0
    prompts, responses = (lengths.tolist() for lengths in batch.row_lengths())
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        if prompt == 0:
            raise ValueError(f"row {row} has an empty prompt: no position predicts its first response token")
        start = batch.prompt_length - prompt
        ids.append(batch.input_ids[row, start : batch.prompt_length + response])
        positions.append(torch.arange(prompt + response))
        row_logit_positions.append(torch.arange(response) + offset + prompt - 1)
        row_slots.append(torch.arange(response) + row * width)
        offset += prompt + response
    input_ids = torch.cat(ids).unsqueeze(0)
    logit_positions, slots = torch.cat(row_logit_positions), torch.cat(row_slots)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=torch.cat(positions).unsqueeze(0),
        logit_positions=logit_positions,
        targets=input_ids[0, logit_positions + 1],
        slots=slots,
        rows=len(batch),
        width=width,
    )


def packed_response_log_probs(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """response_log_probs of a packed batch, laid out (rows, width) as the padded batch's
    (zeros past each response): logits are computed for the real tokens only."""
    kept = logits_only_at(model, packed.logit_positions)
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kept).logits
    response_logits = (logits[0] if kept else logits[0, packed.logit_positions]).float() / temperature
    token_log_probs, entropy = _token_log_probs(response_logits, packed.targets, with_entropy)

    def unpack(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(packed.rows * packed.width)
        return flat.index_put((packed.slots,), values).view(packed.rows, packed.width)

    return unpack(token_log_probs), None if entropy is None else unpack(entropy)
