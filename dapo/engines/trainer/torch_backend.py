"""Plain torch backend: one process, torch AdamW, state via torch.save.

The fallback where DeepSpeed cannot run (no compiler for its JIT ops, an unusual
platform, a quick local debug). Same interface and the same numbers as the DeepSpeed
backend in fp32; no sharding, no data parallelism.

Precision: the parameters (and so the saved weights and the optimizer state) stay in
fp32, which makes a resumed run continue exactly. With dtype bfloat16/float16 on CUDA
the forward runs under torch.autocast; on CPU it runs in fp32 (bf16 was 3x slower on
the AVX2 development machine).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
from pathlib import Path

import torch

from dapo.config import StepConfig
from dapo.engines.trainer.base import STATE_DIR, PolicyTrainer

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
_AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchTrainer(PolicyTrainer):
    backend_name = "torch"

    def __init__(self, config: StepConfig, model_dir: str | Path, device: str | torch.device | None = None):
        super().__init__(config, model_dir)
        from transformers import AutoModelForCausalLM

        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation=config.attn_implementation
        ).to(self._device)
        self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=config.weight_decay,
        )
        state_file = Path(self.model_dir) / STATE_DIR / OPTIMIZER_FILE
        if state_file.is_file():
            self.optimizer.load_state_dict(torch.load(state_file, map_location=self._device, weights_only=True))
            self.resumed = True
            logger.info("resumed torch optimizer state from %s (next step %d)", state_file, self.state.next_step)

    # --- primitives -------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        return self._device

    def autocast(self):
        dtype = _AUTOCAST_DTYPES.get(self.config.dtype)
        if dtype is not None and self._device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=dtype)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self, skip: bool = False) -> tuple[float, bool]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        if skip or not math.isfinite(grad_norm):
            self.zero_grad()
            return grad_norm, False
        self.optimizer.step()
        self.zero_grad()
        return grad_norm, True

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _save_weights(self, out_dir: str) -> None:
        self.model.save_pretrained(out_dir, safe_serialization=True)

    def _save_optimizer(self, state_dir: str) -> None:
        torch.save(self.optimizer.state_dict(), os.path.join(state_dir, OPTIMIZER_FILE))

    def _release(self) -> None:
        del self.optimizer, self.model  # their memory goes; a released trainer is not used again
        if self._device.type == "cuda":  # as in the DeepSpeed backend: only GPU memory needs it
            gc.collect()
            torch.cuda.empty_cache()
