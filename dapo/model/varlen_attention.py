"""Varlen attention without flash attention: torch's sdpa run on each row of a packed sequence.

transformers attends a packed sequence (``dapo.algorithm.batch.pack``: rows end to end, positions
restarting at 0 on each) within its rows by a block-diagonal mask under sdpa and eager,
which costs the packed length squared, padding-free in name only; flash attention's varlen
kernels need a GPU and the flash-attn package. This attention function (registered as
``"sdpa_varlen"``, DAPOConfig.attn_implementation) cuts the sequence where its positions
restart and runs causal sdpa on each row alone: the cost of each row's own length, on
any device. It takes packed sequences only (a batch of one row, no mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_varlen"


def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, heads, T, d), key and value (1, kv_heads, T, d) -> (1, T, heads, d), as
    transformers' sdpa_attention_forward returns it."""
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None:
        raise ValueError(
            f"{NAME} attends packed sequences only (remove_padding: one row of rows end to end, "
            f"positions restarting per row, no mask); got a batch of {query.shape[0]}"
        )
    length = query.shape[2]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    bounds = list(zip(starts, starts[1:] + [length])) if starts and starts[0] == 0 else [(0, length)]
    rows = [
        F.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            is_causal=True,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=True,
        )
        for a, b in bounds
    ]
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make NAME a transformers attn_implementation (idempotent). Its mask is None: the
    rows' bounds come from the positions, so no (T, T) mask is built."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)
