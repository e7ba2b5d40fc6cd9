"""Rule-based rewards for DAPO (Yu et al. 2025, arXiv 2503.14476).

Per response y_i to question q with ground truth a:

    R_task(y_i, a)    = the row's scorer (SCORERS by name, or a user's function); DAPO's:
    R_correct(y_i, a) = +1 if is_equivalent(extract(y_i), a) else -1   (sec. 2.4, rule-based reward)
    R_length(y_i)     = 0                                  if |y_i| <= L_max - L_cache
                        ((L_max - L_cache) - |y_i|) / L_cache  if L_max - L_cache < |y_i| <= L_max
                        -1                                  if |y_i| > L_max   (sec. 3.4, soft overlong punishment)
    R_i = R_task + overlong_factor * R_length + w_fmt(step) * format_score   (w_fmt: ours)

The paper has no format reward; `format_weight` is the project's optional soft format term
(0 keeps the paper's reward; `DAPOConfig.format_reward_weight`, off by default). A user's
scorer runs in the worker processes below, under the same time limit as math-verify.

Verification order, cheapest first:
  1. extract the answer (last "Answer:" line, else last ``\\boxed{}``); none -> wrong.
  2. `normalize_answer` both sides; equal strings -> right. Both plain decimals but unequal
     -> wrong (canonical decimals are equal iff their strings are). Most DAPO-Math answers
     are integers, so most calls end here in microseconds.
  3. otherwise math-verify (parse + verify) in a pool of worker processes (pebble) with a
     hard time limit: math-verify's own timeouts use signal.alarm, which only works in the
     main thread, and a stuck sympy call cannot be interrupted from another thread. The
     worker arms a soft SIGALRM deadline in its own main thread (so ordinary slow cases do
     not cost a new worker) and the pool kills it if it still runs at the hard deadline.
     Workers are fresh interpreters started by loky's start method (never forked: the
     caller may hold torch / vLLM threads), which, unlike multiprocessing's spawn and
     forkserver, does not re-run the caller's ``__main__``: a script without an
     ``if __name__ == "__main__":`` guard, a notebook or a pyflyte task all get math-verify.

A verdict math-verify did not give (its time limit, an error in it, an answer too long for
it) counts as wrong and is marked `unverified` with the reason (`judge_answer`); the pipeline
counts those per step (train/unverified, val/unverified, reward/unverified_share) and stops a
run whose share passes `max_unverified_share`. A worker that dies on a response (a crash in C,
out of memory) is named at WARNING and the response scored once more in a new worker; a
response that kills a second worker raises ScorerError. Workers that cannot start at all raise
`VerifierUnavailable`: the reward never silently becomes an exact-match reward.

Model text is never evaluated as code: only string operations here, and math-verify's
parser (ANTLR LaTeX grammar / sympy's restricted parse_expr) in the worker.

Nothing here imports flytekit; the module is safe to import from any thread or process.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing.util
import numbers
import os
import re
import resource
import signal
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import pebble
from loky.backend.context import get_context

from dapo.plugins import is_user_spec, load_user_function
from dapo.plugins import resolve as resolve_plugin

__all__ = [
    "extract_answer",
    "normalize_answer",
    "verify_answer",
    "judge_answer",
    "Verdict",
    "VerifierUnavailable",
    "overlong_penalty",
    "format_score",
    "format_reward_weight",
    "Scorer",
    "SCORERS",
    "register_scorer",
    "dapo_math",
    "reasoning_gym",
    "ScorerError",
    "TaskScore",
    "task_score",
    "score_response",
    "score_responses",
]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Work caps. Model text can be anything (1 MB of "{", binary junk): every scan below is
# linear and bounded by one of these, independent of the length of the response.
# ---------------------------------------------------------------------------------------
ANSWER_SCAN_CHARS = 4096  # "Answer:" lines are searched in the last 4096 characters only
BOXED_SCAN_CHARS = 16384  # \boxed{...} is searched in the last 16384 characters only
MAX_BOXED_CHARS = 2048  # a \boxed{...} argument longer than this is treated as unbalanced
MAX_BRACE_DEPTH = 64  # ... and so is one nested deeper than this
MAX_BOXED_CANDIDATES = 16  # how many \boxed occurrences (from the end) are tried
MAX_VERIFY_CHARS = 1024  # longer answers / ground truths skip math-verify (-> not equal)


# ---------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------

# A line that starts with "Answer:" (any case), optionally behind markdown decorations
# ("**Answer:** 42", "## Answer: 42", "> Answer: 42", "- Answer: 42") and optionally as
# "Final Answer:". Anchored at the line start, no nested quantifiers: linear per line.
_ANSWER_LINE_RE = re.compile(r"[ \t>#*_\-]*(?:final[ \t]+)?answer[ \t*_]*[:\uff1a](.*)", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape (\{, \}) or a bare brace
_SPACES_RE = re.compile(r"[ \t\r\n]*")
_BARE_ARG_RE = re.compile(r"[^\s${}\\]{1,64}")  # "\boxed 5": TeX's unbraced argument


def _answer_line_content(line: str) -> str | None:
    """Content after "Answer:" on `line` (stripped of spaces and markdown stars), else None."""
    m = _ANSWER_LINE_RE.match(line)
    if m is None:
        return None
    return m.group(1).strip().strip("*").strip()


def _tail_lines(text: str, n_chars: int) -> list[str]:
    """Lines of the last `n_chars` characters, without a first line cut in the middle."""
    tail = text[-n_chars:]
    lines = tail.splitlines()
    if len(text) > n_chars and text[-n_chars - 1] not in "\r\n" and lines:
        lines = lines[1:]  # its beginning lies before the window: it does not "start" there
    return lines


def _last_answer_line(text: str) -> str | None:
    for line in reversed(_tail_lines(text, ANSWER_SCAN_CHARS)):
        content = _answer_line_content(line)
        if content:  # an empty "Answer:" (e.g. answer on the next line) does not count
            return content
    return None


def _braced_argument(s: str, i: int) -> tuple[str, int] | None:
    """Argument of a macro whose name ends at s[i]: ``{...}`` (balanced) or one bare token.

    Returns (content, end index) or None if there is none within the caps. Escaped braces
    (``\\{``) do not count. Work is bounded by MAX_BOXED_CHARS whatever the input.
    """
    n = len(s)
    blanks = _SPACES_RE.match(s, i)  # "\\boxed {x}"; a regex, not a Python loop, on long blanks
    i = blanks.end() if blanks else i
    if i >= n:
        return None
    if s[i] != "{":
        m = _BARE_ARG_RE.match(s, i)
        return (m.group(0), m.end()) if m else None
    depth = 0
    for m in _BRACE_TOKEN_RE.finditer(s, i, min(n, i + MAX_BOXED_CHARS + 2)):
        tok = m.group(0)
        if tok == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                return None
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1 : m.start()], m.end()
    return None  # unbalanced (truncated generation) or over the length cap


def _last_boxed(text: str) -> str | None:
    tail = text[-BOXED_SCAN_CHARS:]
    starts = [m.end() for m in _BOXED_RE.finditer(tail)]
    for pos in reversed(starts[-MAX_BOXED_CANDIDATES:]):
        arg = _braced_argument(tail, pos)
        if arg is not None and arg[0].strip():
            return arg[0].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer string ŷ from response y, or None.

    1. the content of the LAST line starting with "Answer:" (the layout the DAPO prompt
       asks for; case-insensitive; markdown like ``**Answer:**`` and "Final Answer:" allowed;
       a line with nothing after the colon is skipped), searched in the last
       ANSWER_SCAN_CHARS (4096) characters;
    2. else the argument of the last ``\\boxed{...}`` / ``\\boxed {...}`` / ``\\fbox{...}``
       with balanced braces (nesting and escaped braces handled), searched in the last
       BOXED_SCAN_CHARS (16384) characters; an unbalanced last box (truncated output)
       falls back to the one before it;
    3. else None.

    Linear in the scanned window and independent of len(text) beyond it.
    """
    if not isinstance(text, str) or not text:
        return None
    answer = _last_answer_line(text)
    if answer is not None:
        return answer
    return _last_boxed(text)


# ---------------------------------------------------------------------------------------
# Normalization (the fast exact-match path)
# ---------------------------------------------------------------------------------------

_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mathit|mbox)\s*\{([^{}]*)\}")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle(?![A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°|\\circ(?![A-Za-z])\s*$")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~")
_VAR_PREFIX_RE = re.compile(r"^[A-Za-z]\s*=\s*")
_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)|\\frac\{[^{}]*\}\{[^{}]*\}"
_UNITS_MULTI = (
    r"(?:(?:sq\.?|square|cubic|cu\.?)\s+)?(?:units?|feet|foot|ft|inch(?:es)?|in|yards?|yd|miles?|mi"
    r"|mm|cm|km|(?:milli|centi|kilo)?met(?:er|re)s?)"
    r"|dollars?|cents?|euros?|pounds?|lbs?|ounces?|oz|grams?|kg|kilograms?"
    r"|degrees?|deg|radians?|rad"
    r"|seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|yrs?"
    r"|lit(?:er|re)s?|ml|gallons?|gal|mph|km/h|m/s"
)
# Multi-letter units may touch the number ("5cm"); single letters must be separated by
# space ("5 s", "5 g") because "5m" or "5g" could just as well be a product.
_UNIT_SUFFIX_RE = re.compile(
    rf"^(?P<num>{_NUMBER})\s*(?:(?:{_UNITS_MULTI})(?![A-Za-z])|\s(?:m|s|g|l|h)(?![A-Za-z]))"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?$",
    re.IGNORECASE,
)
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRAC_DIGITS_RE = re.compile(r"\\frac(\d)(\d)")
_SQRT_DIGIT_RE = re.compile(r"\\sqrt(\d)")
_WHITESPACE_RE = re.compile(r"\s+")


def _unwrap_boxed(s: str) -> str:
    """``\\boxed{x}`` -> ``x`` when the whole string is one box (repeatedly, at most 3 times)."""
    for _ in range(3):
        m = _BOXED_RE.match(s)
        if m is None:
            break
        arg = _braced_argument(s, m.end())
        if arg is None or s[arg[1] :].strip():
            break
        s = arg[0].strip()
    return s


def _strip_trailing_percent(s: str) -> str:
    """'10 \\%' -> '10'. String ops, not a regex: `\\s*%$` is quadratic on long blank runs."""
    s = s.rstrip()
    if s.endswith("%"):
        s = s[:-1]
        if s.endswith("\\"):
            s = s[:-1]
    return s.rstrip()


def _canonical_decimal(s: str) -> str:
    """'-007.50' -> '-7.5', '5.' -> '5', '-0' -> '0'. String-only: no int() size limits."""
    sign = ""
    if s.startswith("-"):
        sign, s = "-", s[1:]
    whole, _, frac = s.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else sign + out


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer for exact comparison (not a math parser).

    Rules, in order (each cheap, linear, documented by why):
      - unicode minus (U+2212) -> "-"; LaTeX "{,}" -> "," (1{,}000).
      - drop ``\\left``, ``\\right``, ``\\big``-family and ``\\displaystyle`` (sizing only).
      - drop math delimiters: ``\\$`` and ``$`` (currency and inline math look the same
        in answers), ``\\(``, ``\\)``, ``\\[``, ``\\]``.
      - unwrap a whole-string ``\\boxed{...}`` / ``\\fbox{...}``.
      - ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\dbinom``/``\\tbinom`` -> ``\\binom``.
      - unwrap ``\\text{...}``, ``\\mathrm{...}``, ``\\mbox{...}`` etc. (keep the content:
        "\\text{yes}" stays "yes"; units are removed by the unit rule below).
      - drop degree marks (``^\\circ``, ``^{\\circ}``, ``°``, ``\\degree``) and a trailing
        percent sign ("10\\%" -> "10": "what percent" questions take the bare number).
      - LaTeX spacing (``\\,``, ``\\;``, ``\\!``, ``\\ ``, ``\\quad``, ``~``) -> space.
      - strip trailing periods ("42." -> "42").
      - drop a single-letter assignment prefix when it is the only "=" ("x = 5" -> "5").
      - drop ONE unit after a plain number or ``\\frac{a}{b}``: lengths, areas
        ("sq units", "cm^2"), money (dollars, cents), angles, time, mass, volume, speed.
        Count nouns ("12 ways") are left to math-verify.
      - thousands separators: a number whose commas group digits by exactly three with no
        space ("1,000", "12,345.5") loses its commas; anything else with commas ("1,2",
        "1, 234", "1,23") is kept as a list/tuple. "1,234" is read as 1234, not [1, 234].
      - remove all whitespace, then write every remaining comma as ", " (one canonical list
        separator: "(1,2)" and "( 1 , 2 )" both give "(1, 2)");
        ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``;
        drop a leading "+".
      - plain decimals are canonicalized ("05" -> "5", "2.50" -> "2.5", "-0" -> "0").
    Case is kept (x and X, \\pi and \\Pi differ).

    The rules are applied until nothing changes (at most 8 passes; usually 2), so the result
    is a fixed point: normalize_answer(normalize_answer(s)) == normalize_answer(s).
    """
    s = str(s)
    for _ in range(8):
        out = _normalize_once(s)
        if out == s:
            break
        s = out
    return s


def _normalize_once(s: str) -> str:
    """One pass of the `normalize_answer` rules."""
    s = s.strip()
    s = s.replace("\u2212", "-").replace("{,}", ",")
    s = _LEFT_RIGHT_RE.sub("", s)  # first: "\\left(" must not leave a "\\(" delimiter behind
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    s = _unwrap_boxed(s.strip())
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\dbinom", "\\binom").replace("\\tbinom", "\\binom")
    for _ in range(3):  # \text{\textbf{cm}}: a few levels, each pass linear
        s, n = _TEXT_WRAPPER_RE.subn(r"\1", s)
        if not n:
            break
    s = _DEGREE_RE.sub("", s)
    s = _strip_trailing_percent(s)
    s = _LATEX_SPACE_RE.sub(" ", s).strip().rstrip(".").strip()
    if s.count("=") == 1:
        s = _VAR_PREFIX_RE.sub("", s)
    m = _UNIT_SUFFIX_RE.match(s)
    if m:
        s = m.group("num")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # Lists keep ", " as their separator so that "1, 234" (a pair) never becomes "1,234",
    # which the thousands rule above would read as 1234 on a second pass.
    s = _WHITESPACE_RE.sub("", s).rstrip(".").replace(",", ", ")
    s = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_DIGIT_RE.sub(r"\\sqrt{\1}", s)
    if s.startswith("+"):
        s = s[1:]
    if _PLAIN_NUMBER_RE.fullmatch(s):
        s = _canonical_decimal(s)
    return s


# ---------------------------------------------------------------------------------------
# math-verify in worker processes (a pebble ProcessPool)
# ---------------------------------------------------------------------------------------

_SOFT_DEADLINE_FRACTION: float | None = 0.85  # a worker interrupts itself at this share of the limit
_MAX_POOL_FAILURES = 3  # pools broken in a row (workers that cannot start) before raising
_START_TIMEOUT_S = 60.0  # importing sympy + math-verify in a cold container
# A fresh interpreter per worker (no fork of a process holding torch / vLLM / pyarrow
# threads) that, unlike multiprocessing's spawn, does not re-run the caller's __main__.
_WORKER_START_METHOD = get_context("loky")


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


def _math_verify(gold: str, pred: str) -> bool | str:
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


_POOL = _VerifierPool(_default_workers())


def _forget_pool_after_fork() -> None:
    """In a forked child the parent's pool (whose threads did not survive the fork) is not
    ours to use or stop: start afresh."""
    global _POOL
    _POOL = _VerifierPool(_POOL.max_workers)


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _as_math_verify_latex(s: str) -> str:
    """Strip the answer's own math delimiters and wrap it once in ``$...$`` for math-verify."""
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    return f"${s.strip()}$"


# ---------------------------------------------------------------------------------------
# Public rewards
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """is_equivalent(ŷ, a) and how it was decided."""

    correct: bool
    unverified: bool = False
    """True when math-verify was needed but gave no verdict (its time limit, an error in it,
    an answer longer than MAX_VERIFY_CHARS): counted as wrong, and counted (train/unverified)."""
    note: str = ""
    """Why there is no verdict (empty when there is one)."""


def judge_answer(text: str, ground_truth: str, timeout_s: float = 2.0) -> Verdict:
    """is_equivalent(ŷ, a): does response `text` end with an answer equal to `ground_truth`?

    Exact path first (extract, `normalize_answer`, string equality; two plain decimals that
    differ are final). Otherwise math-verify in a worker process, at most `timeout_s`
    seconds of verification (a worker's start-up, at first use and after each kill, and any
    wait for a free worker when all `DAPO_VERIFY_WORKERS` are busy, are not counted).
    What math-verify cannot decide counts as wrong, marked unverified. Safe from any thread.
    A non-str ground truth (an int from a data file) is str()-ed. Raises
    VerifierUnavailable if math-verify's workers cannot start.
    """
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if not isinstance(text, str) or ground_truth is None:
        return Verdict(False)
    gold = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    pred = extract_answer(text)
    if pred is None:
        return Verdict(False)
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if not norm_pred or not norm_gold:
        return Verdict(False)
    if norm_pred == norm_gold:
        return Verdict(True)
    if _PLAIN_NUMBER_RE.fullmatch(norm_pred) and _PLAIN_NUMBER_RE.fullmatch(norm_gold):
        return Verdict(False)  # canonical decimals: different strings are different numbers
    if len(pred) > MAX_VERIFY_CHARS or len(gold) > MAX_VERIFY_CHARS:
        return Verdict(
            False,
            unverified=True,
            note=f"answer of {max(len(pred), len(gold))} chars, over math-verify's {MAX_VERIFY_CHARS}",
        )
    ok = _POOL.run(
        _math_verify,
        (_as_math_verify_latex(gold), _as_math_verify_latex(pred)),
        float(timeout_s),
        f"math-verify on the answer {pred[:80]!r}",
    )
    if ok is None:
        return Verdict(False, unverified=True, note=f"math-verify gave no verdict within {timeout_s:g} s")
    if isinstance(ok, str):
        _warn_once(
            "math-verify raised on the answer %r (against %r): %s. Such answers count as wrong and in "
            "train/unverified; this message is shown once.",
            pred[:80],
            gold[:80],
            ok,
        )
        return Verdict(False, unverified=True, note=f"math-verify raised {ok}")
    return Verdict(ok)


_warned: set[str] = set()


def _warn_once(message: str, *args: object) -> None:
    """logger.warning(message, *args) the first time this message is given in the process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message, *args)


def verify_answer(text: str, ground_truth: str, timeout_s: float = 2.0) -> bool:
    """`judge_answer(...).correct`: whether the response's answer equals the ground truth."""
    return judge_answer(text, ground_truth, timeout_s).correct


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """Soft overlong punishment R_length(y) (paper sec. 3.4, Overlong Reward Shaping), times `factor`.

    With L_max = `max_len`, L_cache = `buffer_len` and |y| = `length` (response tokens):
        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max  (0 .. -1)
        -1                                  if |y| > L_max
    times `factor` (verl's overlong_penalty_factor). `buffer_len == 0` has no soft zone:
    0 up to L_max, -factor beyond. The penalty is continuous at both ends of the buffer.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in [0, max_len={max_len}], got {buffer_len}")
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor must be a finite number >= 0, got {factor}")
    expected_len = max_len - buffer_len
    if length <= expected_len:
        return 0.0
    if length > max_len:
        return -1.0 * factor
    return (expected_len - length) / buffer_len * factor  # buffer_len > 0 here


def format_score(text: str) -> float:
    """1.0 if the response's last non-blank line is "Answer: <non-empty>", else 0.0.

    The line is matched exactly as `extract_answer` matches Answer lines (case-insensitive,
    markdown like ``**Answer:**`` allowed), so a score of 1 means the answer is read from
    that line. Only the last ANSWER_SCAN_CHARS characters are examined.
    """
    if not isinstance(text, str):
        return 0.0
    stripped = text.rstrip()
    if not stripped:
        return 0.0
    lines = _tail_lines(stripped, ANSWER_SCAN_CHARS)
    if not lines:
        return 0.0
    return 1.0 if _answer_line_content(lines[-1]) else 0.0


def format_reward_weight(step: int, decay_steps: int, initial_weight: float = 1.0) -> float:
    """w_fmt(step): linear decay from `initial_weight` at step 0 to 0 at step >= `decay_steps`.

    `decay_steps == 0` turns the format reward off (always 0), the paper's setting.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if decay_steps < 0:
        raise ValueError(f"decay_steps must be >= 0, got {decay_steps}")
    if decay_steps == 0 or step >= decay_steps:
        return 0.0
    return float(initial_weight) * (1.0 - step / decay_steps)


# ---------------------------------------------------------------------------------------
# Task scorers: R_task by name, chosen per row by its data_source
# ---------------------------------------------------------------------------------------

Scorer = Callable[[str, str, dict], "float | Mapping[str, float] | TaskScore"]
"""A task's reward: scorer(response, ground_truth, extra_info) -> a score, or a dict with
"score" and any named metrics (floats). An "acc" entry (1/0) is what dynamic sampling
filters on (else acc = 1 when score > 0); "unverified" (1/0) marks a verdict the scorer
could not give. extra_info is the data row's extra_info with its "data_source"."""

SCORERS: dict[str, Scorer] = {}
"""Scorers by name (register_scorer): the config names one (reward_fn), or one per
data_source (reward_fn_by_source)."""

RESERVED_SCORE_KEYS = ("score", "acc", "unverified")


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Add a scorer to SCORERS under `name`."""

    def add(scorer: Scorer) -> Scorer:
        SCORERS[name] = scorer
        return scorer

    return add


@register_scorer("dapo_math")
def dapo_math(response: str, ground_truth: str, extra_info: dict) -> TaskScore:
    """DAPO's rule-based reward (sec. 2.4): R_correct = +1 if is_equivalent(ŷ, a) else -1,
    with ŷ the answer on the last "Answer:" line (else the last \\boxed{}), equal to `a`
    after normalize_answer or by math-verify (judge_answer)."""
    verdict = judge_answer(response, ground_truth)
    return TaskScore(
        1.0 if verdict.correct else -1.0, float(verdict.correct), float(verdict.unverified), note=verdict.note
    )


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(text: str, ground_truth: str) -> float:
    """1.0 if the response's last number (anywhere, in any layout) is the ground truth: whether
    the model knew the answer, whatever the line it wrote it on (a format-blind probe, no reward)."""
    numbers = _NUMBER_RE.findall(text[-ANSWER_SCAN_CHARS:]) if isinstance(text, str) else []
    return float(bool(numbers) and normalize_answer(numbers[-1]) == normalize_answer(str(ground_truth)))


@register_scorer("reasoning_gym")
def reasoning_gym(response: str, ground_truth: str, extra_info: dict) -> dict[str, float]:
    """reasoning-gym's own verdict: ŷ read by our "Answer:" line rule (extract_answer), scored
    by the task's `score_answer(ŷ, entry)` on the entry regenerated from the row's extra_info
    (dapo.gym_tasks). Correct iff that score is >= 1.0: many tasks give partial credit to an
    answer that merely contains the truth ("the answer is 7" for 7), which must not reward
    padding. R_task = +1 / -1 from it; the task's raw score (`rg_score`) and whether the last
    number of the response is the answer (`last_number`) are logged beside it."""
    from dapo.gym_tasks import entry_of

    task = extra_info.get("rg_task", "?")
    try:
        data, entry = entry_of(extra_info)
    except KeyError as error:
        raise ScorerError(
            f"scorer 'reasoning_gym': the row has no {error} in extra_info (not made from a reasoning_gym: spec)"
        ) from error
    answer = extract_answer(response)
    try:
        raw = data.score_answer(answer, entry)
    except Exception as error:
        raise ScorerError(
            f"reasoning-gym task {task!r}: score_answer raised {type(error).__name__}: {error}"
        ) from error
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real) or not math.isfinite(raw):
        raise ScorerError(f"reasoning-gym task {task!r}: score_answer returned {raw!r}, not a finite number")
    correct = answer is not None and float(raw) >= 1.0
    return {
        "score": 1.0 if correct else -1.0,
        "acc": float(correct),
        "rg_score": float(raw),
        "last_number": last_number_matches(response, ground_truth),
    }


class ScorerError(RuntimeError):
    """A user's scorer raised or returned something other than a score: the message
    names the scorer and shows its error; no reward is made up for the response."""


@dataclass(frozen=True)
class TaskScore:
    """What a scorer said about one response."""

    score: float
    acc: float
    unverified: float = 0.0
    metrics: tuple[tuple[str, float], ...] = ()
    """The scorer's own named metrics (train/score/<name>, val/score/<name> in MLflow)."""
    note: str = ""
    """Why there is no verdict, when unverified."""

    @classmethod
    def of(cls, result: object, scorer: str) -> TaskScore:
        """A scorer's return value (a score, a dict of them, or a TaskScore) as a TaskScore;
        ScorerError when it is not a score."""
        if isinstance(result, TaskScore):
            return result
        values = result if isinstance(result, Mapping) else {"score": result}
        if "score" not in values:
            raise ScorerError(f"scorer {scorer!r} returned a dict without 'score': {sorted(values)}")
        numbers = {}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ScorerError(f"scorer {scorer!r} returned {key}={value!r}: every value must be a finite number")
            numbers[str(key)] = float(value)
        score = numbers.pop("score")
        acc = numbers.pop("acc", 1.0 if score > 0 else 0.0)
        unverified = numbers.pop("unverified", 0.0)
        return cls(
            score,
            acc,
            unverified,
            tuple(sorted(numbers.items())),
            note=f"scorer {scorer!r} said unverified" if unverified else "",
        )


def _user_score_in_worker(spec: str, response: str, ground_truth: str, extra_info: dict) -> tuple[str, object]:
    """Run a user's scorer in a verifier worker: ("ok", TaskScore) or ("error", the
    traceback as text: the scorer's own exception classes need not unpickle here)."""
    try:
        return "ok", TaskScore.of(load_user_function(spec, "scorer")(response, ground_truth, extra_info), spec)
    except ScorerError as error:
        return "error", str(error)
    except Exception:
        return "error", traceback.format_exc(limit=-3)


def task_score(spec: str, response: str, ground_truth: str, extra_info: dict, timeout_s: float = 2.0) -> TaskScore:
    """R_task of one response by the scorer `spec` names (plugins.resolve). A registered
    scorer runs here; a user's ("module:function", "file.py:function") runs in a verifier
    worker under the same time limit as math-verify (no verdict past it: wrong and unverified), so that a hung
    or memory-hungry scorer cannot stall or kill the task. Raises ScorerError."""
    if not is_user_spec(spec):
        return TaskScore.of(resolve_plugin(spec, SCORERS, "scorer")(response, ground_truth, extra_info), spec)
    outcome = _POOL.run(
        _user_score_in_worker,
        (spec, response, ground_truth, extra_info),
        timeout_s,
        f"scorer {spec!r} on a response starting {response[:80]!r}",
    )
    if outcome is None:  # DAPO's wrong answer, counted in train/unverified as math-verify's missing verdicts are
        return TaskScore(
            score=-1.0, acc=0.0, unverified=1.0, note=f"scorer {spec!r} gave no verdict within {timeout_s:g} s"
        )
    status, value = outcome
    if status == "error":
        raise ScorerError(f"scorer {spec!r} failed on a response starting {response[:80]!r}:\n{value}")
    return value


def score_response(
    text: str,
    ground_truth: str,
    response_length: int,
    *,
    max_len: int,
    buffer_len: int,
    overlong_factor: float,
    format_weight: float,
    scorer: str = "dapo_math",
    extra_info: dict | None = None,
    timeout_s: float = 2.0,
) -> dict[str, object]:
    """Everything the pipeline records for one response y_i.

    reward = R_task + R_length * overlong_factor + format_weight * format_score, with
    R_task from `scorer` (task_score; dapo_math: +1 / -1). `acc` (1.0 / 0.0) is what
    dynamic sampling filters on (std of acc within a group > 0); `unverified` (1.0 / 0.0)
    marks a verdict the scorer did not give, `verdict_note` why; `score_metrics` the scorer's
    own metrics.
    """
    task = task_score(scorer, text, ground_truth, extra_info or {}, timeout_s)
    penalty = overlong_penalty(response_length, max_len, buffer_len, overlong_factor)
    fmt = format_score(text)
    return {
        "reward": task.score + penalty + format_weight * fmt,
        "acc": task.acc,
        "score": task.score,
        "overlong_penalty": penalty,
        "format_score": fmt,
        "unverified": task.unverified,
        "verdict_note": task.note,
        "score_metrics": dict(task.metrics),
    }


def score_responses(
    texts: list[str],
    ground_truths: list[str],
    response_lengths: list[int],
    *,
    scorers: list[str] | None = None,
    extra_infos: list[dict] | None = None,
    **settings,
) -> list[dict[str, object]]:
    """`score_response` (same keyword `settings`) for each response of a batch, in order;
    scorers / extra_infos: each response's (default: settings' scorer, {}).

    Several responses at a time, from threads, so that every verifier worker has a task
    while others wait (benchmarks/verifier.py measures the gain).
    """
    n = len(texts)
    scorers = scorers or [settings.pop("scorer", "dapo_math")] * n
    extra_infos = extra_infos or [{}] * n

    def one(i: int) -> dict[str, object]:
        return score_response(
            texts[i], ground_truths[i], response_lengths[i], scorer=scorers[i], extra_info=extra_infos[i], **settings
        )

    with ThreadPoolExecutor(2 * _POOL.max_workers) as threads:
        return list(threads.map(one, range(n)))
