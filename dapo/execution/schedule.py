"""Which steps a run validates and how its steps are cut into chunks (train_chunk nodes)."""

from __future__ import annotations

from dapo.config import DAPOConfig


def is_validation_step(step: int, val_every: int, total_steps: int) -> bool:
    """Validate every val_every steps (counted after the update) and after the last step."""
    return step == total_steps or (val_every > 0 and step % val_every == 0)


def chunk_ranges(config: DAPOConfig) -> list[tuple[int, int]]:
    """[first_step, last_step) of each train_chunk: steps_per_chunk steps, the last chunk
    what is left. A colocated chunk also ends at every validation step: only a checkpoint
    that leaves a chunk (its task's output) can be validated and registered, so each
    validation costs that mode one trainer and engine start (choose val_every as a multiple
    of steps_per_chunk where starts are expensive)."""
    n = config.steps_per_chunk
    end_set = set(range(n, config.total_steps, n)) | {config.total_steps}
    if config.execution == "colocated":
        end_set |= {
            step
            for step in range(1, config.total_steps)
            if is_validation_step(step, config.val_every, config.total_steps)
        }
    ends = sorted(end_set)
    return list(zip([0, *ends[:-1]], ends))
