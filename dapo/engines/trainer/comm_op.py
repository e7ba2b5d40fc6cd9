"""DeepSpeed's CPU shared-memory comm op (deepspeed_shm_comm), built where the environment is
made and never left locked.

DeepSpeed on CPU loads this op when it starts (deepspeed.comm's build_shm_op), and torch's
cpp_extension JIT-builds it the first time in an environment: ~60-70 s on 2 cores. torch
guards a build with a lock file in the build directory (FileBaton) that names no owner, so a
process killed during the build (Ctrl-C twice, the OOM killer, a pod's eviction) leaves it
behind, and every later start waits on it forever, printing nothing.

`ensure_comm_op` loads (building if need be) under a lock of our own, an flock, which the
kernel releases when its holder dies: whoever holds it knows that no live process of ours is
building, so a torch lock file found then is a dead build's and is removed. It says what it
waits for after WAIT_NOTICE_S. `make setup` builds the op beforehand (`python -m
dapo.engines.trainer.comm_op`), so that no run pays for it. The cluster's trainer pods run DeepSpeed
on CUDA, which does not use this op.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("dapo.engines.trainer.comm_op")  # also when run as __main__ (make setup)

WAIT_NOTICE_S = 5.0
"""Wait this long for another process's build before saying so."""
BUILD_DELAY_ENV = "DAPO_TEST_COMM_OP_BUILD_DELAY_S"
"""Test hook: seconds the build sleeps while torch's lock file exists, so that a test can kill it there."""


def use_cpu_accelerator_without_gpus() -> None:
    """DeepSpeed picks its accelerator from DS_ACCELERATOR when it is first imported."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def shm_comm_builder():
    """DeepSpeed's builder of the op, as deepspeed.comm asks for it; None where DeepSpeed does
    not use it (GPU accelerators, a build it marks incompatible)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def ensure_comm_op() -> Path | None:
    """Build (or load) the op under our own lock, removing a lock file that a killed build
    left; its build directory, or None where DeepSpeed does not use it."""
    from torch.utils import cpp_extension

    builder = shm_comm_builder()
    if builder is None:
        return None
    build_dir = Path(cpp_extension._get_build_directory(builder.NAME, verbose=False))
    with exclusive(
        build_dir.with_name(f"{build_dir.name}.dapo-lock"), f"the build of DeepSpeed's {builder.NAME} op in {build_dir}"
    ):
        torch_lock = build_dir / "lock"
        if torch_lock.exists():
            logger.warning(
                "removing %s: a build of %s killed before it ended left it (no live build holds our lock)",
                torch_lock,
                builder.NAME,
            )
            torch_lock.unlink()
        if not (build_dir / f"{builder.NAME}.so").exists():
            logger.warning(
                "building DeepSpeed's %s op once for this environment in %s (~1 min on 2 cores; "
                "`make setup` builds it beforehand)",
                builder.NAME,
                build_dir,
            )
        with _delayed_build(float(os.environ.get(BUILD_DELAY_ENV, 0) or 0)):
            builder.load(verbose=False)
    return build_dir


@contextlib.contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """Hold an flock on `path` (our pid written in it), saying after WAIT_NOTICE_S whom we wait
    for. The kernel releases it when the holder exits, however it exits."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started, noticed = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not noticed and time.monotonic() - started > WAIT_NOTICE_S:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    logger.warning("waiting for %s by process %s (lock %s)", what, holder, path)
                    noticed = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _delayed_build(seconds: float) -> Iterator[None]:
    """BUILD_DELAY_ENV's hook: torch's build step sleeps first, inside torch's own lock."""
    if not seconds:
        yield
        return
    from torch.utils import cpp_extension

    build = cpp_extension._write_ninja_file_and_build_library

    def slow_build(*args, **kwargs):
        time.sleep(seconds)
        return build(*args, **kwargs)

    cpp_extension._write_ninja_file_and_build_library = slow_build
    try:
        yield
    finally:
        cpp_extension._write_ninja_file_and_build_library = build


if __name__ == "__main__":  # make setup
    from dapo.logs import configure_logging

    configure_logging()
    use_cpu_accelerator_without_gpus()
    built = ensure_comm_op()
    print(f"DeepSpeed's shm comm op: {built or 'not used on this accelerator'}")
