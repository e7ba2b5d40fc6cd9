"""For test subprocesses that run with a HOME of their own (a fresh Flyte cache, a fresh
MLflow database): the build and model-info caches of this machine, as a user's next run
would find them, so each run does not pay for them again."""

import os
from pathlib import Path


def machine_caches() -> dict[str, str]:
    return {
        # DeepSpeed's JIT-built comm op (~40 s a build on 2 cores)
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")),
        # vLLM's model-info cache: without it every engine start inspects the model in a
        # subprocess first (~10 s: a second vLLM import)
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm")),
    }
