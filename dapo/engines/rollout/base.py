"""What every rollout backend shares: settings, results, the engine interface.

Conventions (identical for every backend, so that a rollout table does not depend
on which engine wrote it):

- Prompts arrive as rendered text and are tokenized here, with the model dir's
  tokenizer and without special tokens; backends receive token ids.
- `token_ids` of a completion are the generated tokens, padding excluded. When a
  sample stops on an end-of-sequence token (the tokenizer's eos, or one of the
  `eos_token_id`s of generation_config.json) that token IS included, as vLLM
  returns it, and `finish_reason` is "stop" (even when it is also the
  max_tokens-th token: vLLM checks the stop token first). Nothing after it is
  returned. A sample cut by max_tokens (or by max_model_len) is "length".
- `log_probs[i]` is log p(token_ids[i]) under the distribution sampled from:
  logits / temperature, then top_p renormalization (at temperature 1, top_p 1
  these are the raw model log-probs, which is what `dapo.algorithm.batch.response_log_probs`
  recomputes). Greedy decoding (temperature 0) reports the raw log-probs.
- `text` is `tokenizer.batch_decode(token_ids, skip_special_tokens=True)`.
- Sampling ignores the checkpoint's generation_config sampling defaults
  (top_k, repetition penalty, ...): only SamplingSettings apply.
- Every (prompt_index, sample_index) gets its own seed derived from
  (settings.seed, prompt_index, sample_index) (see `request_seed`), so one call
  is reproducible and samples of different prompts are not correlated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dapo.config import StepConfig

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]

# config.json keys that fix the parameter shapes: a checkpoint whose values differ
# cannot be swapped in place.
ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is started with, whichever the backend: one definition for both, and
    (frozen, hashable) the part of cached_rollout_engine's key that they share."""

    dtype: str = "float32"
    """The weights' dtype in the engine, by vLLM's names ("float32", "bfloat16", "float16")."""
    max_model_len: int = 512
    """The most tokens of one sequence, prompt and response together."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (vLLM; the hf backend runs on one device and warns)."""
    seed: int = 0
    """The engine's own seed (vLLM's); each sample draws from its own seed (request_seed)."""

    @classmethod
    def from_config(cls, config: StepConfig) -> EngineSettings:
        """A run's engine: the trainer's dtype, room for the longest prompt and response, the
        rollout's tensor parallelism, the run's seed."""
        return cls(
            dtype=config.dtype,
            max_model_len=config.max_prompt_length + config.max_response_length,
            tensor_parallel_size=config.tensor_parallel_size,
            seed=config.seed,
        )


DEFAULT_ENGINE_SETTINGS = EngineSettings()
"""The settings of an engine started without any (a float32 engine of 512 tokens: tests, benchmarks)."""


@dataclass
class SamplingSettings:
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # vLLM's threshold for greedy sampling


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    log_probs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" or "length"

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 31-bit seed for one sample, stable across processes and platforms."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    return json.loads(path.read_text())


def architecture_of(config: dict) -> dict:
    return {key: config.get(key) for key in ARCHITECTURE_KEYS}


def safetensors_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors files")
    return files


def iter_safetensors(checkpoint_dir: str | os.PathLike):
    """(name, tensor) pairs of a safetensors checkpoint, one file at a time."""
    from safetensors.torch import load_file

    for path in safetensors_files(checkpoint_dir):
        yield from load_file(str(path)).items()


def checkpoint_tensor_names(checkpoint_dir: str | os.PathLike) -> list[str]:
    """The tensor names of a safetensors checkpoint (headers only, no weights read)."""
    from safetensors import safe_open

    names = []
    for path in safetensors_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def checkpoint_fingerprint(checkpoint_dir: str | os.PathLike) -> tuple:
    """Path, sizes and modification times of the weight files: changes when the weights do."""
    directory = Path(checkpoint_dir).resolve()
    files = sorted(directory.glob("*.safetensors")) + [directory / "config.json"]
    return (str(directory),) + tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists())


def stop_token_ids(tokenizer, model_dir: str | os.PathLike) -> list[int]:
    """The tokenizer's eos plus generation_config.json's eos_token_id(s), as vLLM stops on both."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor generation_config.json names an eos token")
    return ids


class RolloutEngine(ABC):
    """Generates sampled completions with per-token log-probs; swaps weights in place.

    Subclasses implement `_open`, `_generate`, `_load_weights`, `_load_tensors` and `_close`.
    """

    backend: str = ""

    def __init__(
        self, model_dir: str | os.PathLike, settings: EngineSettings = DEFAULT_ENGINE_SETTINGS, **backend_options: Any
    ):
        """An engine on model_dir's weights. backend_options are the backend's own (its `_open`'s
        keywords): one constructor, so that the settings both backends share are handled once."""
        from transformers import AutoTokenizer

        shared = sorted(set(backend_options) & {f.name for f in dataclasses.fields(EngineSettings)})
        if shared:  # as keywords they would reach vllm.LLM twice, or the hf backend not at all
            raise TypeError(f"{', '.join(shared)}: pass them in settings (EngineSettings), not as backend options")

        self.model_dir = str(model_dir)
        self.settings = settings
        self.architecture = architecture_of(read_config(self.model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.model_dir)
        # which files the live weights came from; None after load_tensors (no file holds them)
        self.weights_fingerprint: tuple | None = checkpoint_fingerprint(self.model_dir)
        self._closed = False
        self.released = False
        """Whether release_memory freed the engine's weights: it cannot generate until it gets weights again."""
        self._open(**backend_options)

    # --- the interface --------------------------------------------------------
    def generate(
        self, prompts: list[str], sampling: SamplingSettings, progress: ProgressFn | None = None
    ) -> list[Completion]:
        """len(prompts) * sampling.n completions ordered by (prompt_index, sample_index)."""
        self._check_open()
        if self.released:
            raise RuntimeError(
                f"{self!r} released its memory (release_memory): give it weights (load_weights_from_tensors) first"
            )
        sampling.validate()
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, not a string")
        # No early return for no prompts: an engine stepping in lockstep with others (vLLM's
        # data parallelism under the external launcher) still takes its turns until all finish.
        prompt_token_ids = self.tokenize(prompts) if prompts else []
        for index, ids in enumerate(prompt_token_ids):
            if not ids:
                raise ValueError(f"prompt {index} is empty after tokenization")
            if len(ids) >= self.settings.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(ids)} tokens; max_model_len is {self.settings.max_model_len}: "
                    "no room to generate"
                )
        completions = self._generate(prompt_token_ids, sampling, progress)
        expected = len(prompts) * sampling.n
        if len(completions) != expected:  # a backend bug, never the caller's
            raise RuntimeError(f"{self.backend} returned {len(completions)} completions, expected {expected}")
        return completions

    def load_weights(self, checkpoint_dir: str | os.PathLike) -> None:
        """Swap to another checkpoint of the same architecture, in place where possible."""
        self._check_open()
        checkpoint_dir = str(checkpoint_dir)
        architecture = architecture_of(read_config(checkpoint_dir))
        if architecture != self.architecture:
            raise ValueError(
                f"{checkpoint_dir} has another architecture than {self.model_dir}: "
                f"{ {k: (self.architecture[k], v) for k, v in architecture.items() if self.architecture[k] != v} }; "
                "start a new engine for it"
            )
        fingerprint = checkpoint_fingerprint(checkpoint_dir)
        self._load_weights(checkpoint_dir)
        self.released = False
        self.model_dir = checkpoint_dir
        self.weights_fingerprint = fingerprint

    def load_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Swap to weights held in memory, in place: (Hugging Face name, tensor) pairs of this
        architecture, e.g. a colocated trainer's parameters (PolicyTrainer.named_weights).
        No file is read or written."""
        self._check_open()
        self._load_tensors(named_tensors)
        self.released = False
        self.weights_fingerprint = None  # no file holds the live weights: a later load_weights always reloads

    def release_memory(self) -> bool:
        """Free the accelerator memory the engine holds between rollouts, its weights and KV
        cache (for a colocated trainer's update); returns whether it did. Released, it
        cannot generate until load_weights_from_tensors (or load_weights) gives it weights
        again. Default: nothing to free (the backend has no such mode, or it is off)."""
        self._check_open()
        self.released = self._release_memory()
        return self.released

    def close(self) -> None:
        """Release the engine; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        settings = f"dtype={self.settings.dtype}, max_model_len={self.settings.max_model_len}"
        return f"{type(self).__name__}({self.model_dir!r}, {settings}, {state})"

    # --- shared helpers -------------------------------------------------------
    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]

    def decode(self, token_ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(token_ids, skip_special_tokens=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    # --- backend hooks --------------------------------------------------------
    @abstractmethod
    def _open(self, *args: Any, **backend_options: Any) -> None:
        """Start the backend on self.model_dir with the keyword options it declares (once, from
        __init__); this signature lets an override declare any."""

    @abstractmethod
    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, progress: ProgressFn | None
    ) -> list[Completion]: ...

    @abstractmethod
    def _load_weights(self, checkpoint_dir: str) -> None: ...

    @abstractmethod
    def _load_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _release_memory(self) -> bool:
        return False
