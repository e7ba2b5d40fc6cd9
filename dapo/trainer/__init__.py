"""The DAPO policy step, independent of the training backend.

One ``PolicyTrainer`` lives for one policy step: it loads the policy (and, when the
checkpoint holds one, the optimizer state) at start, runs the updates, writes the
next checkpoint and is closed. Two backends implement it:

- ``deepspeed``: a DeepSpeed engine (ZeRO stage from the config), the production
  path, on CUDA on a cluster and on CPU here (``DS_ACCELERATOR=cpu``);
- ``torch``: plain torch AdamW in one process, the fallback where DeepSpeed cannot run.

``policy_update`` is the algorithm (Yu et al. 2025, arXiv 2503.14476):

1. group-normalised advantages ``group_advantages(reward, group_id)``;
2. collate; old log-probs (and token entropy) recomputed by the trainer without grad;
3. loss mask = response mask, minus truncated rows when ``overlong_filtering``;
4. ``ppo_epochs`` passes over mini-batches of ``ppo_mini_batch_size`` whole groups,
   shuffled with a generator seeded by (config.seed, step, epoch);
5. per mini-batch, micro-batches of ``micro_batch_size`` responses whose agg losses
   are weighted by their share of the mini-batch's valid tokens (token-mean) or of
   its sequences with a valid token (seq modes), so the accumulated gradient is
   exactly that of the whole mini-batch's loss; clip at ``grad_clip``; AdamW step at
   lr = ``lr * min(1, (step + 1) / warmup_steps)`` (linear warm-up over policy steps,
   then constant);
6. an update whose loss or gradient norm is not finite is not applied (counted in
   ``nonfinite_updates``; the caller decides whether to stop).

Across data-parallel ranks (DeepSpeed with WORLD_SIZE > 1) every rank holds the
whole scored table: the old-log-prob pass and the micro-batches of each mini-batch
are dealt round-robin over the ranks, each micro loss is scaled by the world size
(DeepSpeed averages gradients over ranks), and ranks short of a micro-batch run a
zero-weight one so that all ranks run the same collectives.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import torch
import torch.nn.functional as F

from dapo import checkpoint
from dapo.advantages import group_advantages, group_index
from dapo.batch import PolicyBatch, collate_table, response_log_probs
from dapo.config import DAPOConfig
from dapo.loss import masked_mean, policy_loss

logger = logging.getLogger(__name__)

STATE_DIR = "trainer_state"
"""Sub-directory of a checkpoint with the optimizer state and the step counters."""
META_FILE = "meta.json"

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
    def load(cls, model_dir: str | Path) -> "TrainerState | None":
        path = Path(model_dir) / STATE_DIR / META_FILE
        if not path.is_file():
            return None
        values = json.loads(path.read_text())
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def lr_at(config: DAPOConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps`` policy steps (step 0 gets lr / warmup_steps), then constant."""
    if config.warmup_steps <= 0:
        return config.lr
    return config.lr * min(1.0, (step + 1) / config.warmup_steps)


def shuffle_seed(seed: int, step: int, epoch: int) -> int:
    digest = hashlib.sha256(f"dapo-minibatch:{seed}:{step}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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

    def __init__(self, config: DAPOConfig, model_dir: str | Path):
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
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU copies of the parameters (gathered where sharded); for tests and tools."""

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

    def barrier(self) -> None:
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
        config = self._hf_config()
        for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0

    def _hf_config(self):
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

        Padding columns shared by all rows are trimmed for the pass and restored as zeros.
        """
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
        size = max(1, self.forward_micro_batch_size)
        n, width = len(batch), batch.responses.shape[1]
        log_probs = torch.zeros((n, width), dtype=torch.float32)
        entropy = torch.zeros((n, width), dtype=torch.float32)
        chunks = list(torch.arange(n).split(size))
        mine = chunks[self.rank :: self.world_size]
        per_rank = -(-len(chunks) // self.world_size)
        self.train_mode(False)
        for i in range(per_rank):
            # Ranks short of a chunk run a discarded one: sharded (ZeRO-3) forwards are collectives.
            chunk = mine[i] if i < len(mine) else chunks[0]
            lp, ent = self.forward(batch.select(chunk), temperature, with_entropy=True)
            if i < len(mine):
                log_probs[chunk] = lp.float().cpu()
                entropy[chunk] = ent.float().cpu()
        if self.world_size > 1:
            log_probs = self.all_reduce_sum(log_probs)
            entropy = self.all_reduce_sum(entropy)
        mask = batch.response_mask.to(torch.float32)
        return log_probs * mask, entropy * mask

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
                self._copy_tokenizer_files(tmp)
                self.state.world_size = self.world_size
                meta = {**asdict(self.state), "config": self.config.to_dict()}
                Path(state_dir, META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
            self.barrier()
            if self.is_main:
                checkpoint.commit(tmp, final, step=step, extra={"backend": self.backend_name, "updates": self.state.updates})
            committed = True
        finally:
            if not committed and self.is_main:
                checkpoint.abort(tmp)
        self.barrier()

    def _copy_tokenizer_files(self, out_dir: str) -> None:
        """Copy the source dir's other top-level files (tokenizer, chat template, ...) not written yet."""
        source = Path(self.model_dir)
        for item in sorted(source.iterdir()):
            if not item.is_file() or item.name in _NOT_COPIED or item.name.endswith(_WEIGHT_SUFFIXES):
                continue
            target = Path(out_dir) / item.name
            if not target.exists():
                shutil.copy2(item, target)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self) -> "PolicyTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_trainer(config: DAPOConfig, model_dir: str | Path) -> PolicyTrainer:
    """The trainer of config.trainer_backend on model_dir (resuming model_dir/trainer_state if present)."""
    if config.trainer_backend == "deepspeed":
        from dapo.trainer.deepspeed_backend import DeepSpeedTrainer

        return DeepSpeedTrainer(config, model_dir)
    if config.trainer_backend == "torch":
        from dapo.trainer.torch_backend import TorchTrainer

        return TorchTrainer(config, model_dir)
    raise ValueError(f"unknown trainer_backend {config.trainer_backend!r}")


def launcher_rank() -> int:
    """This process's global rank as its launcher (torchrun, a PyTorchJob) set it; 0 when alone."""
    return int(os.environ.get("RANK", "0"))


def rank0_value(make: Callable[[], Any]) -> Any:
    """make() run on rank 0 only and its result returned on every rank (alone: just make()).

    Where the launcher started several processes this initialises the process group
    first (DeepSpeed's, which the trainer reuses), e.g. to agree on one output path.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return make()
    import torch.distributed as dist

    from dapo.trainer.deepspeed_backend import init_distributed

    init_distributed()
    holder = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def local_rank0_first(work: Callable[[], Any]) -> None:
    """work() on each node's local rank 0 while the node's other ranks wait.

    For work that fills a node-local path all ranks then read (the input checkpoint's
    download): one process does it instead of every rank writing the same files at once.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        work()
        return
    import torch.distributed as dist

    from dapo.trainer.deepspeed_backend import init_distributed

    init_distributed()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        work()
    dist.barrier()


def prune_step_dirs(parent: str | os.PathLike, keep: int, prefix: str = "policy-") -> list[str]:
    """Remove all but the newest `keep` step directories `<prefix><step>-*` under parent.

    Newest = highest step, then latest modification (a retried step leaves a second
    directory of the same step). Returns the removed paths.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []

    def age_key(path: Path) -> tuple[int, float]:
        step = path.name[len(prefix):].split("-", 1)[0]
        return (int(step) if step.isdigit() else -1, path.stat().st_mtime)

    candidates = sorted((p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix)), key=age_key)
    removed = candidates[: max(0, len(candidates) - keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in removed]


# --- the DAPO step ------------------------------------------------------------------
@dataclass
class StepData:
    """A scored batch in tensor form with everything the updates need."""

    batch: PolicyBatch
    advantages: torch.Tensor  # (B,)
    old_log_probs: torch.Tensor  # (B, R)
    entropy: torch.Tensor  # (B, R)
    loss_mask: torch.Tensor  # (B, R) float
    group_rows: list[torch.Tensor]  # row indices of each group, in order of first appearance
    metrics: dict[str, float]


def prepare_step(trainer: PolicyTrainer, scored: pa.Table, config: DAPOConfig, temperature: float) -> StepData:
    """Advantages, collated tensors, old log-probs (no grad) and the loss mask."""
    if scored.num_rows == 0:
        raise ValueError("policy_update needs a non-empty scored batch")
    group_ids = scored.column("group_id").to_pylist()
    advantages = group_advantages(scored.column("reward").to_pylist(), group_ids)
    batch = collate_table(scored, trainer.pad_token_id)
    response_mask = batch.response_mask.to(torch.float32)
    loss_mask = response_mask.clone()
    truncated = torch.tensor([bool(t) for t in scored.column("truncated").to_pylist()])
    if config.overlong_filtering:
        loss_mask[truncated] = 0.0

    old_log_probs, entropy = trainer.log_probs(batch, temperature)

    index = group_index(group_ids)
    group_rows = [(index == g).nonzero().flatten() for g in range(int(index.max()) + 1)]

    lengths = response_mask.sum(dim=-1)
    metrics = {
        "entropy": masked_mean(entropy, response_mask).item(),
        "response_length_mean": lengths.mean().item(),
        "response_length_max": lengths.max().item(),
        "tokens": response_mask.sum().item(),
        "loss_tokens": loss_mask.sum().item(),
        "truncated_frac": truncated.float().mean().item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
        "groups": float(len(group_rows)),
        "rollout_logprob_diff": _rollout_diff(scored, old_log_probs, batch.response_mask),
    }
    return StepData(batch, advantages, old_log_probs, entropy, loss_mask, group_rows, metrics)


def _rollout_diff(scored: pa.Table, old_log_probs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Mean |recomputed - rollout| log-prob over tokens of rows whose rollout log-probs cover the response."""
    total, count = 0.0, 0
    for row, values in enumerate(scored.column("rollout_log_probs").to_pylist()):
        n = int(response_mask[row].sum())
        if not values or len(values) < n or n == 0:
            continue
        rollout = torch.as_tensor(values[:n], dtype=torch.float32)
        total += (old_log_probs[row, :n] - rollout).abs().sum().item()
        count += n
    return total / count if count else float("nan")


_METRIC_KEYS = ("pg_loss", "clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_dual", "approx_kl", "ratio_mean")


def minibatch_backward(
    trainer: PolicyTrainer, data: StepData, rows: torch.Tensor, config: DAPOConfig, temperature: float
) -> dict[str, float] | None:
    """Accumulate the gradient of one mini-batch's loss over micro-batches (no optimizer step).

    Returns the mini-batch's metrics (token-weighted over micro-batches and ranks) with
    "nonfinite" = 1.0 when a micro loss was not finite (its backward then poisons the
    gradient with NaN so the step is refused everywhere), or None when the mini-batch
    has no valid token (nothing to learn; no update).
    """
    mask = data.loss_mask[rows]
    seq_mode = config.loss_agg_mode != "token-mean"
    total_tokens = mask.sum().item()
    total_units = (mask.sum(dim=-1) > 0).sum().item() if seq_mode else total_tokens
    if total_units == 0:
        return None
    size = config.micro_batch_size or len(rows)
    chunks = list(rows.split(size))
    per_rank = -(-len(chunks) // trainer.world_size)
    mine = [(c, True) for c in chunks[trainer.rank :: trainer.world_size]]
    mine += [(chunks[0], False)] * (per_rank - len(mine))  # zero-weight filler: same collectives on every rank

    width = data.batch.responses.shape[1]
    if config.loss_agg_mode == "seq-mean-token-sum-norm":
        width = max(width, config.max_response_length)  # Dr. GRPO's constant L_max, not the padded width

    sums = torch.zeros(len(_METRIC_KEYS) + 1, dtype=torch.float64)  # weighted metrics, then nonfinite flag
    trainer.train_mode(True)
    trainer.zero_grad()
    for i, (chunk, counts) in enumerate(mine):
        micro = data.batch.select(chunk)
        log_probs, _ = trainer.forward(micro, temperature)
        pad = width - log_probs.shape[1]
        device = log_probs.device
        micro_mask = data.loss_mask[chunk]
        loss, loss_metrics = policy_loss(
            log_probs if pad == 0 else F.pad(log_probs, (0, pad)),
            F.pad(data.old_log_probs[chunk], (0, pad)).to(device),
            data.advantages[chunk].to(device),
            F.pad(micro_mask, (0, pad)).to(device),
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            clip_ratio_c=config.clip_ratio_c,
            agg=config.loss_agg_mode,
        )
        micro_tokens = micro_mask.sum().item()
        micro_units = (micro_mask.sum(dim=-1) > 0).sum().item() if seq_mode else micro_tokens
        share = micro_units / total_units if counts else 0.0
        token_share = micro_tokens / total_tokens if counts else 0.0
        finite = bool(torch.isfinite(loss))
        if finite:
            scaled = loss * (share * trainer.world_size)
            sums[0] += loss.item() * share
            for k, key in enumerate(_METRIC_KEYS[1:], start=1):
                sums[k] += loss_metrics[key] * token_share
        else:
            # NaN reaches every parameter's gradient: the backend refuses the step (all ranks agree).
            scaled = log_probs.sum() * float("nan")
            sums[-1] = 1.0
        trainer.backward(scaled, last_micro_batch=i == len(mine) - 1)
    if trainer.world_size > 1:
        sums = trainer.all_reduce_sum(sums)
    out = {key: sums[k].item() for k, key in enumerate(_METRIC_KEYS)}
    out["nonfinite"] = 1.0 if sums[-1].item() > 0 else 0.0
    return out


class RolloutGapExceeded(RuntimeError):
    """The batch's rollout log-probs are too far from the trainer's: no update was made."""

    def __init__(self, gap: float, threshold: float):
        super().__init__(f"mean |rollout - trainer| log-prob {gap:.3g} > {threshold:.3g}")
        self.gap = gap
        self.threshold = threshold


def policy_update(
    trainer: PolicyTrainer, scored: pa.Table, config: DAPOConfig, step: int, temperature: float,
    max_rollout_gap: float | None = None,
) -> dict[str, float]:
    """One DAPO policy step on a scored batch (SCORED_SCHEMA rows); returns float metrics.

    Metrics: pg_loss, clipfrac, clipfrac_high, clipfrac_low, clipfrac_dual, approx_kl,
    ratio_mean, grad_norm (pre-clip) averaged over applied updates; lr; entropy (mean
    token entropy under the policy before the step); rollout_logprob_diff (mean |old -
    rollout| log-prob, NaN when the rollout gave none); response_length_mean/max;
    tokens (valid response tokens), loss_tokens (after overlong filtering);
    num_updates (applied), nonfinite_updates (refused), empty_updates (mini-batches
    with no valid token); step_seconds.

    max_rollout_gap: raise RolloutGapExceeded before any update when rollout_logprob_diff
    exceeds it (every rank computes the same value from all-reduced log-probs).
    """
    started = time.perf_counter()
    if step != trainer.state.next_step:
        logger.info("policy_update step=%d; the loaded trainer state expected step %d", step, trainer.state.next_step)
    data = prepare_step(trainer, scored, config, temperature)
    gap = data.metrics["rollout_logprob_diff"]
    if max_rollout_gap is not None and gap == gap and gap > max_rollout_gap:  # NaN: no rollout log-probs to compare
        raise RolloutGapExceeded(gap, max_rollout_gap)
    lr = lr_at(config, step)
    trainer.set_lr(lr)

    totals = dict.fromkeys((*_METRIC_KEYS, "grad_norm"), 0.0)
    applied = nonfinite = empty = 0
    n_groups = len(data.group_rows)
    for epoch in range(config.ppo_epochs):
        generator = torch.Generator().manual_seed(shuffle_seed(config.seed, step, epoch))
        order = torch.randperm(n_groups, generator=generator).tolist()
        for start in range(0, n_groups, config.ppo_mini_batch_size):
            rows = torch.cat([data.group_rows[g] for g in order[start : start + config.ppo_mini_batch_size]])
            result = minibatch_backward(trainer, data, rows, config, temperature)
            if result is None:
                empty += 1
                continue
            grad_norm, ok = trainer.step(skip=result["nonfinite"] > 0)
            if not ok:
                nonfinite += 1
                logger.warning(
                    "step %d epoch %d: update refused (loss %s, grad norm %s)", step, epoch, result["pg_loss"], grad_norm
                )
                continue
            applied += 1
            for key in _METRIC_KEYS:
                totals[key] += result[key]
            totals["grad_norm"] += grad_norm
    trainer.finish_step(step, applied)

    metrics = {key: (value / applied if applied else float("nan")) for key, value in totals.items()}
    metrics.update(data.metrics)
    metrics.update(
        lr=lr,
        num_updates=float(applied),
        nonfinite_updates=float(nonfinite),
        empty_updates=float(empty),
        step_seconds=time.perf_counter() - started,
    )
    return {key: float(value) for key, value in metrics.items()}


__all__ = [
    "META_FILE",
    "STATE_DIR",
    "PolicyTrainer",
    "RolloutGapExceeded",
    "StepData",
    "TrainerState",
    "launcher_rank",
    "lr_at",
    "make_trainer",
    "minibatch_backward",
    "policy_update",
    "prepare_step",
    "rank0_value",
    "trim_batch",
]
