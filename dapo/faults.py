"""Fault injection for the reliability tests: a real SIGKILL at a named point.

DAPO_CRASH_AT="<point>@<step>" (e.g. "checkpoint_commit@2") kills the process with
SIGKILL when execution reaches that point at that step. Unset (always, outside the
tests) it does nothing.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "DAPO_CRASH_AT"
POINTS = ("rollout", "policy_step", "checkpoint_commit")


def crash_point(point: str, step: int | None) -> None:
    """SIGKILL this process if DAPO_CRASH_AT names this point and step."""
    wanted = os.environ.get(CRASH_ENV, "")
    if wanted and wanted == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
