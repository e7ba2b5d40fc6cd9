"""Where a colocated process's memory goes, printed at each chunk's first step so that a user
can size a machine: the trainer's weights, gradients and optimizer state, the rollout
engine's copy of the weights and its KV cache, and a micro-batch's activations, against
what the process holds (resident now and at its peak).

Weights and optimizer state are read off the tensors; gradients and the engine's weights
are their sizes by construction (gradients come and go within the update), the activations
an estimate (activation_bytes).
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GIB = 2**30


def tensor_bytes(tensors) -> int:
    import torch  # here: benchmarks read resident_gib without torch

    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def parameter_count(module: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters (or the trainable ones), shared ones once (tied embeddings); a ZeRO-3
    partitioned one at its full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad or not trainable_only)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of an optimizer's per-parameter state (AdamW: exp_avg and exp_avg_sq)."""
    state = getattr(optimizer, "state", None) or getattr(getattr(optimizer, "optimizer", None), "state", {})
    return sum(tensor_bytes(entry.values()) for entry in state.values() if isinstance(entry, dict))


def resident_gib() -> tuple[float, float]:
    """This process's resident memory now and at its peak (Linux), GiB."""
    with open("/proc/self/status") as status:
        now = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024
    return now / GIB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def activation_bytes(hf_config, tokens: int, response_share: float) -> float:
    """What one micro-batch of `tokens` keeps for its backward, float32, estimated: per token
    and layer the block's inputs and outputs (~10 x hidden_size) and the MLP's (3 x
    intermediate_size); then the logits, their log-softmax and its gradient over the response
    tokens (the LM head runs on those only: dapo.algorithm.batch.logits_only_at)."""
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    intermediate = int(getattr(hf_config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    return 4.0 * tokens * (layers * (10 * hidden + 3 * intermediate) + 3 * vocab * response_share)


def memory_breakdown(config, trainer, engine) -> dict[str, float]:
    """GiB by holder (module docstring) for a resident trainer and rollout engine, with
    "resident" and "peak resident"; "rest" is what the process holds beyond the parts
    (libraries, allocator caches, the batch)."""
    module = trainer.module
    count = parameter_count(module)
    weight_bytes = tensor_bytes(module.parameters()) or count * 4
    trainable = parameter_count(module, trainable_only=True)
    engine_dtype_bytes = 2 if engine.settings.dtype in ("bfloat16", "float16", "half") else 4
    hf = trainer.hf_config()
    micro_tokens = config.max_tokens_per_micro_batch or trainer.forward_micro_batch_size * (
        config.max_prompt_length + config.max_response_length
    )
    parts = {
        "weights": weight_bytes / GIB,
        "gradients": trainable * 4 / GIB,
        "optimizer state": optimizer_state_bytes(getattr(trainer, "optimizer", None)) / GIB,
        "engine weights": count * engine_dtype_bytes / GIB,
        "KV cache": (getattr(engine, "kv_cache_bytes", None) or 0) / GIB,
        "activations": activation_bytes(
            hf, micro_tokens, config.max_response_length / (config.max_prompt_length + config.max_response_length)
        )
        / GIB,
    }
    now, peak = resident_gib()
    return {**parts, "rest": max(0.0, peak - sum(parts.values())), "resident": now, "peak resident": peak}


def breakdown_line(parts: dict[str, float], config, engine) -> str:
    """The breakdown as the one line printed at the first step."""
    kv = (
        f" ({engine.max_concurrent_sequences} sequences x {engine.settings.max_model_len} tokens)"
        if getattr(engine, "max_concurrent_sequences", None)
        else ""
    )
    held = ", ".join(
        f"{name} {gib:.2f}{kv if name == 'KV cache' else ''}"
        for name, gib in parts.items()
        if name not in ("resident", "peak resident")
    )
    return (
        f"memory at the first step (GiB; {config.dtype} training, AdamW): {held}; "
        f"resident {parts['resident']:.2f}, peak {parts['peak resident']:.2f}"
    )
