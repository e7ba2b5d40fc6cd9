"""For test subprocesses that run with a HOME of their own (a fresh Flyte cache, a fresh
MLflow database): the build and model-info caches of this machine, as a user's next run
would find them, so each run does not pay for them again."""

import os
import sys
from pathlib import Path


def machine_caches() -> dict[str, str]:
    return {
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
        # vLLM's model-info cache: without it every engine start inspects the model in a
        # subprocess first (~10 s: a second vLLM import)
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm")),
    }


def torch_extensions_dir() -> str:
    """Where torch builds DeepSpeed's CPU comm op (`make setup` does, dapo.engines.trainer.comm_op):
    TORCH_EXTENSIONS_DIR, else torch's default, ~/.cache/torch_extensions/py<version>_cpu
    (torch adds that part only when the variable is unset)."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions" / version))
