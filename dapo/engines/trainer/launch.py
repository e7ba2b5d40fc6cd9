"""What a launched trainer process needs around the trainer.

Under a launcher (torchrun, a PyTorchJob) every rank runs the same task body; these
helpers give its rank, share one rank-0 decision with all ranks, download the input
checkpoint once per node, and prune the step directories the ranks write to. Alone
(no WORLD_SIZE) each is the plain single-process version.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


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

    from dapo.engines.trainer.deepspeed_backend import init_distributed

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

    from dapo.engines.trainer.deepspeed_backend import init_distributed

    init_distributed()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        work()
    dist.barrier()


def prune_step_dirs(
    parent: str | os.PathLike, keep: int, prefix: str = "policy-", spare: str | os.PathLike = ""
) -> list[str]:
    """Remove all but the newest `keep` step directories `<prefix><step>-*` under parent, and
    never `spare` (the directory the caller is still reading from).

    Newest = highest step, then latest modification (a retried step leaves a second
    directory of the same step). Returns the removed paths.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []

    def age_key(path: Path) -> tuple[int, float]:
        step = path.name[len(prefix) :].split("-", 1)[0]
        return (int(step) if step.isdigit() else -1, path.stat().st_mtime)

    candidates = sorted((p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix)), key=age_key)
    spared = Path(spare).resolve() if spare else None
    removed = [p for p in candidates[: max(0, len(candidates) - keep)] if p.resolve() != spared]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in removed]
