"""DeepSpeed backend: a DeepSpeed engine (ZeRO stage from the config) around the HF policy.

CUDA on a cluster (one process per GPU, under torchrun / a PyTorchJob), CPU here
(``DS_ACCELERATOR=cpu``, one process: a 1-rank group on a loopback port, see
`init_distributed`). The process group is initialised once per process and reused by
every engine created later (local runs build one trainer per policy step in one process).

Gradient accumulation is ours, not DeepSpeed's: the config says
``gradient_accumulation_steps: 1`` and every backward goes through
``engine.backward(loss, scale_wrt_gas=False)``, so DeepSpeed never divides the
exactly-weighted micro losses; the accumulation boundary is set explicitly with
``engine.set_gradient_accumulation_boundary`` (False for all but the last
micro-batch of a mini-batch) and ``engine.step()`` runs once per mini-batch.

Non-finite gradients: DeepSpeed's ZeRO optimizer skips the step itself when the
global gradient norm is not finite (fp32 and fp16 always; bf16 with
``check_grad_overflow``, which the config turns on) and clears the accumulated
gradients; ``was_step_applied()`` reports it. policy_update poisons the gradient
with NaN when a micro loss is not finite, so that path also refuses the update on
every rank. ZeRO stage 0 (no ZeRO optimizer) is checked here before ``step``.

Checkpoints: the HF weights come from the module (ZeRO 0-2) or from the gathered
16-bit state dict (ZeRO-3, ``stage3_gather_16bit_weights_on_model_save``); the
optimizer state goes through ``engine.save_checkpoint`` into
``trainer_state/deepspeed/state`` and comes back with ``engine.load_checkpoint``
(fp32 master weights included, so a bf16 run resumes exactly too). Note that
DeepSpeed's checkpoint also holds a copy of the module weights (its standard layout).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import logging
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dapo.config import StepConfig
from dapo.engines.trainer.base import STATE_DIR, PolicyTrainer
from dapo.engines.trainer.comm_op import ensure_comm_op, use_cpu_accelerator_without_gpus

logger = logging.getLogger(__name__)

DS_STATE_SUBDIR = "deepspeed"
DS_TAG = "state"
DEEPSPEED_STATE_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""What DeepSpeed pickles beside tensors in its optimizer state (found in its ZeRO-1/2/3 files):
the only classes `load_state_file` lets torch.load build."""


class CheckpointRefused(RuntimeError):
    """A state file that holds something other than tensors and DeepSpeed's state classes."""


def load_state_file(path: str, map_location=None):
    """torch.load of one of DeepSpeed's state files with weights_only=True: tensors, containers
    and DEEPSPEED_STATE_CLASSES only, so that a file planted on the object store or the shared
    volume cannot run code when a trainer resumes from it (DeepSpeed's own engine loads with
    weights_only=False). CheckpointRefused names the file."""
    import importlib
    import pickle

    classes = [
        getattr(importlib.import_module(module), name)
        for module, _, name in (c.rpartition(".") for c in DEEPSPEED_STATE_CLASSES)
    ]
    with torch.serialization.safe_globals(classes):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            reason = str(error).strip().splitlines()[0]
            raise CheckpointRefused(
                f"{path}: refused to load: it holds more than tensors and DeepSpeed's state ({reason}). "
                "dapo-flyte never writes such a file: it was changed after it was saved, or written by "
                "another program"
            ) from None


SYNC_BUCKET_BYTES = 512 * 2**20
"""Under ZeRO-3 the in-memory sync gathers parameters in buckets of about this many bytes:
one all-gather per bucket rather than per parameter (verl sends buckets, too)."""


def parameter_buckets(named_parameters, bucket_bytes: int) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive (name, parameter) pairs in groups whose whole (gathered) sizes add up to
    at most bucket_bytes; a larger parameter forms a group alone."""
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, param in named_parameters:
        nbytes = getattr(param, "ds_numel", param.numel()) * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> None:
    """Initialise the process group once per process (later engines reuse it).

    Under a launcher (torchrun, a PyTorchJob's workers) its env:// variables say where. A lone
    process gets a 1-rank group on a free loopback port, handed to torch rather than written
    into os.environ: every process started later from this one (the next run, a test's
    subprocess) would inherit that MASTER_PORT, and it may be taken by then (EADDRINUSE).
    """
    use_cpu_accelerator_without_gpus()
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine takes its device from it, only from there
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    ensure_comm_op()  # before DeepSpeed's own load of it, which waits forever on a killed build's lock
    if "WORLD_SIZE" in os.environ:
        deepspeed.init_distributed()
    else:
        deepspeed.init_distributed(
            auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )


def deepspeed_config(config: StepConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for a policy step (batch sizes are nominal: we accumulate ourselves)."""
    zero: dict[str, Any] = {
        "stage": config.zero_stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    if config.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if config.dtype == "bfloat16":
        ds["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif config.dtype == "float16":
        ds["fp16"] = {
            "enabled": True,
            "initial_scale_power": 16,
            "loss_scale_window": 100,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return ds


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _zero3_loading(ds_config: dict[str, Any]):
    """transformers' HfDeepSpeedConfig registered while the trainer's model loads under ZeRO-3.

    With it, from_pretrained builds the model partitioned (deepspeed.zero.Init) instead
    of whole on every rank, which a large model needs. transformers consults it only when
    it builds or loads a model, so it is unregistered after the load: left registered, it
    would have every other model loaded in the process built partitioned too (the rollout
    engine beside a colocated trainer, a validation), each parameter an empty shard. It
    requires the accelerate package; without it the model loads whole on each rank and is
    partitioned by deepspeed.initialize (fine for small models, too much host memory for
    large ones).
    """
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        registered = HfDeepSpeedConfig(ds_config)  # noqa: F841 (alive for the load: transformers keeps a weak reference)
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        # HfDeepSpeedConfig registers itself globally before it checks for accelerate: the
        # half-built object left there breaks every later from_pretrained in the process.
        unset_hf_deepspeed_config()
        logger.warning(
            "ZeRO-3 without partitioned loading (%s): every rank loads the whole model first; "
            "install accelerate (the trainer and gpu images have it) for large models",
            error,
        )
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


class DeepSpeedTrainer(PolicyTrainer):
    backend_name = "deepspeed"

    def __init__(self, config: StepConfig, model_dir: str | Path):
        super().__init__(config, model_dir)
        init_distributed()
        import deepspeed
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.stage = config.zero_stage
        self.state.zero_stage = self.stage
        self.ds_config = deepspeed_config(config, self.world_size)
        # Load in the training dtype: DeepSpeed casts to it anyway (keeping fp32 master
        # weights in the ZeRO optimizer), and a 16-bit load halves host memory.
        with _zero3_loading(self.ds_config) if self.stage == 3 else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=_DTYPES[config.dtype], attn_implementation=config.attn_implementation
            )
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=config.weight_decay,
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        state_dir = Path(self.model_dir) / STATE_DIR / DS_STATE_SUBDIR
        if (state_dir / DS_TAG).is_dir():
            if self.state.world_size != self.world_size:
                logger.warning(
                    "the optimizer state in %s was written by %d rank(s), this run has %d: ZeRO partitions "
                    "follow the data-parallel size, so DeepSpeed may refuse it (convert it with DeepSpeed's "
                    "universal checkpoint tools, or keep the number of training processes fixed)",
                    state_dir,
                    self.state.world_size,
                    self.world_size,
                )
            self.engine.checkpoint_engine.load = load_state_file  # instead of DeepSpeed's weights_only=False
            load_path, _ = self.engine.load_checkpoint(
                str(state_dir),
                tag=DS_TAG,
                load_module_strict=True,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
            if load_path is None:
                raise RuntimeError(f"DeepSpeed could not load the optimizer state in {state_dir}")
            self.resumed = True
            logger.info("resumed DeepSpeed state from %s (next step %d)", state_dir, self.state.next_step)

    # --- primitives -------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def hf_config(self):
        return self.engine.module.config

    def zero_grad(self) -> None:
        # Gradients live in DeepSpeed's buffers until step(); a refused step clears them there.
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, skip: bool = False) -> tuple[float, bool]:
        if self.stage == 0:
            # No ZeRO optimizer: nothing in DeepSpeed checks the norm before stepping.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
            if skip or not math.isfinite(norm):
                self.engine.zero_grad()
                return norm, False
            self.engine.step()
            return norm, self.engine.was_step_applied()
        self.engine.step()
        applied = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if skip and applied:
            raise RuntimeError(
                "DeepSpeed applied an update whose loss was not finite (its overflow check did not fire); "
                "stopping rather than continuing from corrupted weights"
            )
        return norm, applied

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF model's parameters (not the engine's "module."-prefixed names); under ZeRO-3
        gathered whole a bucket at a time (parameter_buckets) and copied: the gathered
        storage is released after each bucket, and the reader may keep a copy longer
        (vLLM's layerwise reload holds a layer's tensors until the layer is complete)."""
        if self.stage != 3:
            for name, param in self.engine.module.named_parameters():
                yield name, param.detach()
            return
        import deepspeed

        for bucket in parameter_buckets(self.engine.module.named_parameters(), SYNC_BUCKET_BYTES):
            with deepspeed.zero.GatheredParameters([param for _, param in bucket]):
                for name, param in bucket:
                    yield name, param.detach().clone()

    # --- distributed helpers ----------------------------------------------------------
    def barrier(self) -> None:
        if self.world_size > 1:
            self._dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        holder = [obj]
        self._dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        dtype = tensor.dtype
        on_device = tensor.to(self.device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        self._dist.all_reduce(on_device)
        return on_device.to("cpu", dtype=dtype)

    # --- checkpoint ------------------------------------------------------------------
    def _save_weights(self, out_dir: str) -> None:
        module = self.engine.module
        if self.stage == 3:
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()  # collective; rank 0 gets it
            if self.is_main:
                module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        elif self.is_main:
            module.save_pretrained(out_dir, safe_serialization=True)

    def _save_optimizer(self, state_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(state_dir, DS_STATE_SUBDIR), tag=DS_TAG, save_latest=False)

    def _release(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
        self.engine = None
        self.optimizer = None
        if torch.cuda.is_available():
            # the engine's reference cycles hold GPU memory until collected; on CPU the
            # automatic collector suffices, and a full collection costs ~0.1 s a step in
            # a process that also holds flytekit, vLLM and MLflow (benchmarks/overhead.py)
            gc.collect()
            torch.cuda.empty_cache()
