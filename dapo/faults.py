"""Which faults are transient, and fault injection for the reliability tests.

`is_transient` says whether an exception is one a retry of the task may not meet again:
the network or an object store dropping a connection, timing out or asking to slow down,
an MLflow server unavailable, a vLLM engine refused its start because another process
still held the GPU's memory (TransientFault). tasks.common.task_entry raises those as flytekit's
FlyteRecoverableException, so that Flyte retries the task (its task_retries); everything
else (a bad config or data row, a scorer's exception, a rollout mismatch) is
non-recoverable: retrying would only fail again.

DAPO_CRASH_AT="<point>@<step>" (e.g. "checkpoint_commit@2") kills the process with
SIGKILL when execution reaches that point at that step; DAPO_TRANSIENT_AT="<point>@<step>"
raises a transient object-store error there, in a Flyte task's first attempt only
(FLYTE_ATTEMPT_NUMBER 0). Unset (always, outside the tests) they do nothing.
"""

from __future__ import annotations

import errno
import os
import re
import signal

CRASH_ENV = "DAPO_CRASH_AT"
TRANSIENT_ENV = "DAPO_TRANSIENT_AT"
POINTS = ("rollout", "policy_step", "checkpoint_commit")

TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EAGAIN,
}
TRANSIENT_S3_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "503",
    "500",
}
TRANSIENT_CLASS_NAMES = {
    # botocore
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    # aiohttp (s3fs, gcsfs)
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientOSError",
    "ClientPayloadError",
    # httpx
    "ConnectError",
    "ReadTimeout",
    "ConnectTimeout",
    "RemoteProtocolError",
    # requests (MLflow's client), whose classes are not the builtins
    "ConnectionError",
    "Timeout",
    "ChunkedEncodingError",
}
"""Transient by their class's name, so that this module imports none of those libraries."""
# INTERNAL_ERROR is also MLflow's default code: not a sign
MLFLOW_TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"}


class TransientFault(RuntimeError):
    """A fault our own code recognised as one a retry may not meet again."""


GPU_HELD_MARGIN_BYTES = 2 * 2**30
"""Memory in use on a GPU at an engine's start that is not another job's: the CUDA
contexts of this pod's own processes (~0.5 GiB each: the task's, vLLM's workers)."""

VLLM_START_REFUSAL = re.compile(r"Free memory on device \S+ \(([\d.]+)/([\d.]+) GiB\) on startup is less than")
"""vLLM's refusal to start for memory (vllm/v1/worker/utils.py), with its own measurement."""


def memory_held_elsewhere(free_bytes: float, total_bytes: float, own_bytes: float) -> float:
    """Bytes in use on the device that neither this process holds (own_bytes: its torch
    allocator's, e.g. a colocated trainer's) nor the CUDA contexts of its pod explain."""
    return max(0.0, total_bytes - free_bytes - own_bytes - GPU_HELD_MARGIN_BYTES)


def engine_start_refusal(error: BaseException, own_bytes: float) -> TransientFault | None:
    """A TransientFault for vLLM's refusal to start for memory when its own measurement
    (free of total) shows another process holding the memory (the previous pod's engine
    not yet gone, another job on the GPU), else None: a refusal that this process's own
    memory explains (a colocated trainer, utilization set too high) fails again on a retry."""
    found = VLLM_START_REFUSAL.search(str(error))
    if not found:
        return None
    free, total = (float(value) * 2**30 for value in found.groups())
    held = memory_held_elsewhere(free, total, own_bytes)
    if not held:
        return None
    return TransientFault(
        f"the vLLM engine's start was refused for memory that another process held "
        f"({(total - free - own_bytes) / 2**30:.1f} GiB in use beyond this process's {own_bytes / 2**30:.1f} GiB); "
        f"a retry may find it free: {error}"
    )


def is_transient(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, is a network or object-store fault
    that a retry may not meet again (see the module docstring)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _transient_itself(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _transient_itself(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError, TransientFault)):
        return True
    if isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in TRANSIENT_CLASS_NAMES for cls in type(error).__mro__):
        return True
    response = getattr(error, "response", None)  # botocore's ClientError
    if isinstance(response, dict) and str(response.get("Error", {}).get("Code", "")) in TRANSIENT_S3_CODES:
        return True
    return type(error).__name__ == "MlflowException" and str(getattr(error, "error_code", "")) in MLFLOW_TRANSIENT_CODES


def crash_point(point: str, step: int | None) -> None:
    """SIGKILL this process if DAPO_CRASH_AT names this point and step; raise a transient
    object-store error if DAPO_TRANSIENT_AT does and this is a task's first attempt."""
    wanted = os.environ.get(CRASH_ENV, "")
    if wanted and wanted == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(TRANSIENT_ENV, "") == f"{point}@{step}" and os.environ.get("FLYTE_ATTEMPT_NUMBER", "0") == "0":
        raise ConnectionResetError(
            errno.ECONNRESET, f"the object store reset the connection ({TRANSIENT_ENV}={point}@{step})"
        )
