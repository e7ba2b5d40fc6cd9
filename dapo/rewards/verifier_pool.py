"""math-verify in worker processes (a pebble ProcessPool) under a hard time limit: POOL.

math-verify's own timeouts use signal.alarm, which works only in a main thread, and a stuck
sympy call cannot be interrupted from another thread: each worker arms a soft deadline in
its own main thread and the pool kills it at the hard one. Workers are fresh interpreters
(loky's start method), never forks of a caller that holds torch or vLLM threads, and do not
re-run the caller's __main__ (a script without a guard, a notebook, a pyflyte task)."""

from __future__ import annotations

import functools
import logging
import multiprocessing.util
import os
import resource
import signal
import threading
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pebble
from loky.backend.context import get_context

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# math-verify in worker processes (a pebble ProcessPool)
# ---------------------------------------------------------------------------------------

_SOFT_DEADLINE_FRACTION: float | None = 0.85  # a worker interrupts itself at this share of the limit
_MAX_POOL_FAILURES = 3  # pools broken in a row (workers that cannot start) before raising
_START_TIMEOUT_S = 60.0  # importing sympy + math-verify in a cold container
# A fresh interpreter per worker (no fork of a process holding torch / vLLM / pyarrow
# threads) that, unlike multiprocessing's spawn, does not re-run the caller's __main__.
_WORKER_START_METHOD = get_context("loky")


class ScorerError(RuntimeError):
    """A user's scorer raised or returned something other than a score: the message
    names the scorer and shows its error; no reward is made up for the response."""


class VerifierUnavailable(RuntimeError):
    """math-verify's worker processes cannot start: no verdict beyond exact matching is possible."""


class _SoftDeadline(BaseException):  # BaseException: math-verify swallows Exception
    """Raised by SIGALRM in a worker whose own deadline has passed."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _SoftDeadline()


def _cap_memory() -> None:
    """Cap a worker's address space at DAPO_VERIFY_MAX_MEM_MB (default 4096; 0: no cap), so
    sympy on "10^{10^{10}}"-like input hits MemoryError instead of the node's OOM killer."""
    try:
        mem_mb = int(os.environ.get("DAPO_VERIFY_MAX_MEM_MB", "4096") or 0)
        if mem_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    except (ValueError, OSError) as e:
        logger.warning("math-verify worker runs without a memory cap: %r", e)


def _start_worker() -> None:
    """pebble's initializer: prepares each new worker before it takes a task, so the time
    it takes (the math-verify import, a second or two) counts against no call's limit.
    An exception here ends the worker; a pool whose workers all end this way breaks."""
    _cap_memory()
    # pebble stops a worker with SIGTERM, handled in Python, and SIGKILLs it 3 s later if it
    # still runs: a worker stuck in one long C call (sympy's big integers) never runs that
    # handler. The default action ends it at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, _on_alarm)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401


@functools.lru_cache(maxsize=4096)  # the G responses of a group share one ground truth
def _parse_gold(gold: str) -> list:
    from math_verify import parse

    return parse(gold, parsing_timeout=None)


def math_verify(gold: str, pred: str) -> bool | str:
    """math-verify's parse + verify of two ``$...$`` strings (its own timeouts off: they use
    signal.alarm too); the exception's text when it raised (no verdict)."""
    from math_verify import parse, verify

    try:
        gold_parsed = _parse_gold(gold)
        pred_parsed = parse(pred, parsing_timeout=None)
        return bool(gold_parsed) and bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:300]


def _in_worker(task, args: tuple, soft_deadline_s: float | None):
    """The pool's task, run in a worker: task(*args), or None if its soft deadline passed
    first. SIGALRM at `soft_deadline_s` ends an ordinary slow case without costing a new
    worker; the pool kills the worker at the hard limit if this does not return by then."""
    try:
        if soft_deadline_s:
            signal.setitimer(signal.ITIMER_REAL, soft_deadline_s)
        try:
            return task(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftDeadline:  # also when it fires inside the `finally` above
        return None


class _VerifierPool:
    """math-verify workers (a pebble ProcessPool), shared by all threads, started at first use.

    pebble times a task from the moment a worker takes it (time spent queued for a busy
    worker is not counted), kills the worker at the limit and starts a replacement. A pool
    breaks when its workers die with no task running, e.g. when math-verify cannot be
    imported; the call then goes to a new pool, and after _MAX_POOL_FAILURES broken pools
    in a row every call raises VerifierUnavailable.
    """

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._pool: pebble.ProcessPool | None = None
        self._failures = 0
        self._unavailable: str | None = None  # why the workers cannot start, after _MAX_POOL_FAILURES
        self._stop_at_exit: multiprocessing.util.Finalize | None = None

    def run(self, task, args: tuple, timeout_s: float, what: str):
        """task(*args) in a worker within `timeout_s` seconds of work; None at the time limit.
        A worker that dies on it (a crash in C, out of memory) is named at WARNING and the
        task runs once more (the pool starts a new worker); a second death raises ScorerError.
        `what` names the task in those messages. Raises VerifierUnavailable."""
        soft = timeout_s * _SOFT_DEADLINE_FRACTION if _SOFT_DEADLINE_FRACTION else None
        deaths = 0
        while True:
            pool = self._running_pool()
            try:
                future = pool.schedule(_in_worker, (task, args, soft), timeout=timeout_s)
            except RuntimeError as e:  # broke since: its manager saw the workers die
                self._discard(pool, repr(e))
                continue
            try:
                return self._result(future, timeout_s)
            except _PoolBroken as broken:
                self._discard(pool, str(broken))
            except _WorkerDied as died:
                deaths += 1
                if deaths == _MAX_WORKER_DEATHS:
                    raise ScorerError(
                        f"{what} killed a verifier worker {deaths} times ({died}): no verdict is possible "
                        "for this response; fix the scorer (or raise DAPO_VERIFY_MAX_MEM_MB)"
                    ) from None
                logger.warning("%s killed its verifier worker (%s); scoring it once more in a new worker", what, died)

    def _running_pool(self) -> pebble.ProcessPool:
        """The current pool (new if need be). Raises VerifierUnavailable once given up."""
        with self._lock:
            if self._unavailable:
                raise VerifierUnavailable(self._unavailable)
            if self._pool is None:
                self._pool = pebble.ProcessPool(
                    self.max_workers, initializer=_start_worker, context=_WORKER_START_METHOD
                )
                # Stop it at exit, before multiprocessing joins the (non-daemon) workers, which
                # would wait forever: pebble's own atexit hook does not run in a process that
                # multiprocessing started (it leaves by os._exit), only this finalizer does.
                self._stop_at_exit = multiprocessing.util.Finalize(None, _stop_pool, (self._pool,), exitpriority=0)
            return self._pool

    def _result(self, future: Future, timeout_s: float):
        # Bounded wait: pebble's limit applies only once a worker has taken the task.
        wait_s = _START_TIMEOUT_S + timeout_s
        try:
            ok = future.result(timeout=wait_s)
        except BrokenProcessPool as e:
            raise _PoolBroken(repr(e)) from e
        except TimeoutError:
            if not future.done():
                future.cancel()
                raise _PoolBroken(f"no worker took a task within {wait_s:.0f} s") from None
            logger.debug("verifier worker killed at the time limit: no verdict")
            return None
        except Exception as e:  # a worker that died (ProcessExpired: out of memory, a crash in C)
            raise _WorkerDied(repr(e)) from e
        with self._lock:
            self._failures = 0
        return ok

    def _discard(self, pool: pebble.ProcessPool, reason: str) -> None:
        """Stop a broken pool; the next call starts another unless too many broke in a row."""
        with self._lock:
            if self._pool is not pool:
                return  # another thread got here first
            self._pool, stop = None, self._stop_at_exit
            self._failures += 1
            if self._failures >= _MAX_POOL_FAILURES:
                self._unavailable = (
                    f"math-verify's worker processes failed to start {self._failures} times in a row ({reason}). "
                    "Check that math-verify imports in a fresh interpreter "
                    "(python -c 'import math_verify') and that DAPO_VERIFY_MAX_MEM_MB leaves it room."
                )
        if stop is not None:
            stop()


class _PoolBroken(Exception):
    """The pool's workers died or never took the task: the pool must be replaced."""


class _WorkerDied(Exception):
    """The worker running the task died (the pool replaces it)."""


_MAX_WORKER_DEATHS = 2  # a response that kills this many workers stops the run


def _stop_pool(pool: pebble.ProcessPool) -> None:
    pool.stop()
    pool.join()


def _default_workers() -> int:
    default = max(1, min(8, os.cpu_count() or 1))
    env = os.environ.get("DAPO_VERIFY_WORKERS", "").strip()
    if not env:
        return default
    try:
        return max(1, int(env))
    except ValueError:
        logger.warning("DAPO_VERIFY_WORKERS=%r is not an integer; using %d", env, default)
        return default


POOL = _VerifierPool(_default_workers())


def _forget_pool_after_fork() -> None:
    """In a forked child the parent's pool (whose threads did not survive the fork) is not
    ours to use or stop: start afresh."""
    global POOL
    POOL = _VerifierPool(POOL.max_workers)


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def as_math_verify_latex(s: str) -> str:
    """Strip the answer's own math delimiters and wrap it once in ``$...$`` for math-verify."""
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    return f"${s.strip()}$"
