"""The policy step's model and optimizer behind one interface, and its checkpoint layout.

One ``PolicyTrainer`` lives for one policy step (per-stage execution), or for the steps
of a colocated run (``dapo.execution.colocated``): it loads the policy (and, when the checkpoint
holds one, the optimizer state) at start, runs the updates (``dapo.engines.update.policy_update``),
writes the next checkpoint and is closed. Two
backends implement it:

- ``deepspeed``: a DeepSpeed engine (ZeRO stage from the config), the production
  path, on CUDA on a cluster and on CPU here (``DS_ACCELERATOR=cpu``);
- ``torch``: plain torch AdamW in one process, the fallback where DeepSpeed cannot run.

A checkpoint is a Hugging Face safetensors directory that transformers and vLLM load,
plus ``trainer_state/`` (the optimizer state and ``meta.json`` with the counters),
committed atomically (``dapo.checkpoint``).
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dapo import checkpoint
from dapo.algorithm.batch import PolicyBatch, pack, packed_response_log_probs, response_log_probs, trim_batch
from dapo.algorithm.micro_batches import plan_micro_batches
from dapo.config import StepConfig
from dapo.model import varlen_attention

STATE_DIR = "trainer_state"
"""Sub-directory of a checkpoint with the optimizer state and the step counters."""
META_FILE = "meta.json"
_PACKED_TENSORS = ("input_ids", "position_ids", "logit_positions", "targets", "slots")

# Files of a source model dir that save_pretrained writes itself (or that must not be copied).
_NOT_COPIED = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    checkpoint.COMPLETE_FILE,
    checkpoint.COMPLETE_FILE + ".partial",
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


@dataclass
class TrainerState:
    """Counters saved with the optimizer state (trainer_state/meta.json)."""

    backend: str = ""
    next_step: int = 0
    """The step index the next policy_update is expected to get (last step + 1)."""
    updates: int = 0
    """Optimizer updates applied so far (over all steps)."""
    world_size: int = 1
    zero_stage: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path) -> TrainerState | None:
        path = Path(model_dir) / STATE_DIR / META_FILE
        if not path.is_file():
            return None
        values = json.loads(path.read_text())
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _to(batch: PolicyBatch, device: torch.device) -> PolicyBatch:
    return PolicyBatch(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        responses=batch.responses.to(device),
        response_mask=batch.response_mask.to(device),
        prompt_length=batch.prompt_length,
    )


class PolicyTrainer(ABC):
    """One policy step's model and optimizer. Subclasses provide the backend primitives.

    The backend-independent parts are here: micro-batched forward passes with the
    response log-probs (``forward``, ``log_probs``) and the checkpoint layout
    (``save``): a Hugging Face safetensors checkpoint that transformers and vLLM load,
    plus ``trainer_state/`` (optimizer state and counters), written atomically.
    """

    backend_name = "abstract"

    def __init__(self, config: StepConfig, model_dir: str | Path):
        varlen_attention.register()  # before a subclass loads the model with config.attn_implementation
        self.config = config
        self.model_dir = str(model_dir)
        self.rank = 0
        self.world_size = 1
        self.resumed = False
        self._closed = False
        previous = TrainerState.load(model_dir)
        if previous is not None and previous.backend not in ("", self.backend_name):
            raise ValueError(
                f"{model_dir}/{STATE_DIR} holds {previous.backend!r} optimizer state, but "
                f"trainer_backend={self.backend_name!r}; the states are not interchangeable "
                f"(remove {STATE_DIR}/ to start the optimizer afresh)"
            )
        self.state = previous or TrainerState()
        self.state.backend = self.backend_name
        # Read now, not at save time: model_dir may be a record that retention deletes once a
        # newer one is written (a resumed colocated run), and every later save needs them.
        self.serving_files = serving_files(model_dir)

    # --- backend primitives -------------------------------------------------------
    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """What forward passes call (the HF model, or the engine wrapping it)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def zero_grad(self) -> None:
        """Start an update: no accumulated gradient."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate d(loss)/d(params) exactly as given (no rescaling by the backend).

        last_micro_batch marks the accumulation boundary (the last backward before step).
        """

    @abstractmethod
    def step(self, skip: bool = False) -> tuple[float, bool]:
        """Clip at config.grad_clip and apply the optimizer; returns (pre-clip grad norm, applied).

        Not applied (gradients dropped, optimizer state untouched) when skip is set or
        the gradient norm is not finite.
        """

    @abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abstractmethod
    def _save_weights(self, out_dir: str) -> None:
        """Write config.json, generation_config.json and safetensors weights (rank 0 writes)."""

    @abstractmethod
    def _save_optimizer(self, state_dir: str) -> None:
        """Write the optimizer state under state_dir (collective where sharded)."""

    @abstractmethod
    def _release(self) -> None: ...

    # --- distributed helpers (single process by default) -----------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:  # noqa: B027 (one process needs no barrier: a no-op, not abstract)
        pass

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def train_mode(self, training: bool) -> None:
        self.module.train(training)

    # --- shared implementation -------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        config = self.hf_config()
        for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0

    def hf_config(self):
        """The policy's transformers config."""
        module = self.module
        return getattr(module, "config", None) or getattr(getattr(module, "module", None), "config", None)

    @property
    def forward_micro_batch_size(self) -> int:
        """Responses per no-grad forward: micro_batch_size, else one mini-batch's worth."""
        return self.config.micro_batch_size or self.config.ppo_mini_batch_size * self.config.n_samples_per_prompt

    def forward(
        self, batch: PolicyBatch, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs (and entropy) of one micro-batch, with grad; (B, R) like the batch.

        Packed (config.remove_padding): no padding is computed at all. Else padding columns
        shared by all rows are trimmed for the pass and restored as zeros.
        """
        if self.config.remove_padding:
            packed = pack(batch)
            packed = replace(packed, **{name: getattr(packed, name).to(self.device) for name in _PACKED_TENSORS})
            with self.autocast():
                return packed_response_log_probs(self.module, packed, temperature, with_entropy)
        width = batch.responses.shape[1]
        trimmed = _to(trim_batch(batch), self.device)
        with self.autocast():
            log_probs, entropy = response_log_probs(self.module, trimmed, temperature, with_entropy)
        pad = width - log_probs.shape[1]
        log_probs = F.pad(log_probs, (0, pad))
        if entropy is not None:
            entropy = F.pad(entropy, (0, pad))
        return log_probs, entropy

    @torch.no_grad()
    def log_probs(self, batch: PolicyBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad, micro-batched (log_probs, entropy), both (B, R) float32 on the CPU."""
        n, width = len(batch), batch.responses.shape[1]
        log_probs = torch.zeros((n, width), dtype=torch.float32)
        entropy = torch.zeros((n, width), dtype=torch.float32)
        rows = torch.arange(n)
        mine, per_rank = plan_micro_batches(
            batch,
            rows,
            micro_batch_size=self.forward_micro_batch_size,
            max_tokens=self.config.max_tokens_per_micro_batch,
            packed=self.config.remove_padding,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.train_mode(False)
        for i in range(per_rank):
            # Ranks short of a chunk run a discarded one: sharded (ZeRO-3) forwards are collectives.
            chunk = mine[i] if i < len(mine) else rows[:1]
            lp, ent = self.forward(batch.select(chunk), temperature, with_entropy=True)
            assert ent is not None  # asked for
            if i < len(mine):
                log_probs[chunk] = lp.float().cpu()
                entropy[chunk] = ent.float().cpu()
        if self.world_size > 1:
            log_probs = self.all_reduce_sum(log_probs)
            entropy = self.all_reduce_sum(entropy)
        mask = batch.response_mask.to(torch.float32)
        return log_probs * mask, entropy * mask

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's parameters under their Hugging Face names, a shared (tied) one once, as
        save_pretrained writes them, without copies: what a colocated rollout engine loads in
        memory after an update. Buffers are left out: updates do not change them."""
        for name, param in self.module.named_parameters():
            yield name, param.detach()

    def finish_step(self, step: int, applied_updates: int) -> None:
        self.state.next_step = step + 1
        self.state.updates += applied_updates

    def save(self, out_dir: str | Path, step: int | None = None) -> None:
        """Write the next checkpoint atomically (see dapo.checkpoint).

        out_dir gets the HF checkpoint (config.json, generation_config.json, safetensors
        weights, the source dir's tokenizer files) and trainer_state/ (optimizer state,
        meta.json). step goes into the COMPLETE marker; default: the last policy step
        this state has run (next_step - 1), None before any.
        """
        if step is None:
            step = self.state.next_step - 1 if self.state.next_step > 0 else None
        final = str(Path(out_dir).absolute())
        tmp = self.broadcast_object(checkpoint.new_tmp_dir(final) if self.is_main else None)
        committed = False
        try:
            self._save_weights(tmp)
            state_dir = os.path.join(tmp, STATE_DIR)
            if self.is_main:
                os.makedirs(state_dir, exist_ok=True)
            self.barrier()
            self._save_optimizer(state_dir)
            if self.is_main:
                self._write_serving_files(tmp)
                self.state.world_size = self.world_size
                meta = {**asdict(self.state), "config": self.config.to_dict()}
                Path(state_dir, META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
            self.barrier()
            if self.is_main:
                checkpoint.commit(
                    tmp, final, step=step, extra={"backend": self.backend_name, "updates": self.state.updates}
                )
            committed = True
        finally:
            if not committed and self.is_main:
                checkpoint.abort(tmp)
        self.barrier()

    def _write_serving_files(self, out_dir: str) -> None:
        """The source dir's other top-level files (tokenizer, chat template, ...), those
        save_pretrained did not write."""
        for name, content in self.serving_files.items():
            target = Path(out_dir) / name
            if not target.exists():
                target.write_bytes(content)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> PolicyTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serving_files(model_dir: str | Path) -> dict[str, bytes]:
    """{name: bytes} of model_dir's top-level files that a checkpoint carries on besides its
    weights and configs: tokenizer, chat template, README (a few MB for real tokenizers)."""
    return {
        item.name: item.read_bytes()
        for item in sorted(Path(model_dir).iterdir())
        if item.is_file() and item.name not in _NOT_COPIED and not item.name.endswith(_WEIGHT_SUFFIXES)
    }
