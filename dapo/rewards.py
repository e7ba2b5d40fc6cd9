"""Rule-based rewards for DAPO (Yu et al. 2025, arXiv 2503.14476).

Per response y_i to question q with ground truth a:

    R_correct(y_i, a) = +1 if is_equivalent(extract(y_i), a) else -1   (sec. 2.4, rule-based reward)
    R_length(y_i)     = 0                                  if |y_i| <= L_max - L_cache
                        ((L_max - L_cache) - |y_i|) / L_cache  if L_max - L_cache < |y_i| <= L_max
                        -1                                  if |y_i| > L_max   (sec. 3.4, soft overlong punishment)
    R_i = R_correct + overlong_factor * R_length + w_fmt(step) * format_score   (w_fmt: ours)

The paper has no format reward; `format_weight` is the project's optional soft format term
(0 keeps the paper's reward, see DESIGN.md).

Verification order, cheapest first:
  1. extract the answer (last "Answer:" line, else last ``\\boxed{}``); none -> wrong.
  2. `normalize_answer` both sides; equal strings -> right. Both plain decimals but unequal
     -> wrong (canonical decimals are equal iff their strings are). Most DAPO-Math answers
     are integers, so most calls end here in microseconds.
  3. otherwise math-verify (parse + verify) in a persistent worker subprocess with a hard
     time limit: math-verify's own timeouts use signal.alarm, which only works in the main
     thread, and a stuck sympy call cannot be interrupted from another thread. The worker
     arms a soft SIGALRM deadline in its own main thread (so ordinary slow cases do not cost
     a respawn) and the caller kills it if it still has not answered at the hard deadline.

Model text is never evaluated as code: only string operations here, and math-verify's
parser (ANTLR LaTeX grammar / sympy's restricted parse_expr) in the worker.

Nothing here imports flytekit; the module is safe to import from any thread or process.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time

__all__ = [
    "extract_answer",
    "normalize_answer",
    "verify_answer",
    "correctness_reward",
    "overlong_penalty",
    "format_score",
    "format_reward_weight",
    "score_response",
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
    i = _SPACES_RE.match(s, i).end()  # "\\boxed {x}"; a regex, not a Python loop, on long blanks
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
# math-verify in a worker subprocess
# ---------------------------------------------------------------------------------------

# Runs as `python -P -c <this>`: no multiprocessing (no re-import of the caller's __main__,
# no fork of a process that holds torch / vLLM threads). Protocol: one JSON object per line
# (ASCII only, so lone surrogates from junk bytes survive); the first line says ready.
_WORKER_SOURCE = r"""
import json, os, signal, sys

def main():
    out = os.fdopen(os.dup(1), "w", encoding="ascii", newline="\n")
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; EOF on stdin ends us

    def send(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:  # sympy on "10^{10^{10}}"-like input must hit MemoryError, not the node's OOM killer
        mem_mb = int(os.environ.get("DAPO_VERIFY_MAX_MEM_MB", "4096") or 0)
        if mem_mb > 0:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    except Exception:
        pass

    class Deadline(BaseException):  # BaseException: math-verify swallows Exception
        pass

    def on_alarm(signum, frame):
        raise Deadline()

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        import logging
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        from functools import lru_cache
        from math_verify import parse, verify
    except BaseException as e:
        send({"ready": False, "err": repr(e)[:500]})
        return

    @lru_cache(maxsize=4096)  # the G responses of a group share one ground truth
    def parse_gold(g):
        return parse(g, parsing_timeout=None)

    send({"ready": True})
    for line in iter(sys.stdin.buffer.readline, b""):
        ok, err = False, None
        try:
            req = json.loads(line)
            soft = req.get("soft")
            try:
                if soft:
                    signal.setitimer(signal.ITIMER_REAL, soft)
                gold = parse_gold(req["g"])
                pred = parse(req["p"], parsing_timeout=None)
                ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Deadline:
            ok, err = False, "soft deadline"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            ok, err = False, repr(e)[:500]
        send({"ok": ok, "err": err})

main()
"""

_WORKER_START_TIMEOUT_S = 60.0  # importing sympy + math-verify in a cold container
_MAX_START_FAILURES = 3  # consecutive failed starts before giving up on math-verify
_SOFT_DEADLINE_FRACTION: float | None = 0.85  # worker interrupts itself at this share of the limit


class _WorkerError(Exception):
    """The worker died, timed out or answered garbage: it must be killed."""


class _Worker:
    """One `python -c _WORKER_SOURCE` subprocess speaking the JSON-lines protocol."""

    def __init__(self) -> None:
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # no cwd on sys.path
        self.proc = subprocess.Popen(
            [sys.executable, *flags, "-c", _WORKER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            close_fds=True,
            start_new_session=True,  # Ctrl-C in the caller's terminal is the caller's business
        )
        self._buf = b""
        self.ready = False

    def _read_message(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select.select: fds above 1024 are common in big processes
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000.0):
                raise _WorkerError("timed out")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _WorkerError(f"exited with {self.proc.poll()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError as e:
            raise _WorkerError("garbled reply") from e

    def wait_ready(self) -> None:
        if self.ready:
            return
        msg = self._read_message(time.monotonic() + _WORKER_START_TIMEOUT_S)
        if not msg.get("ready"):
            raise RuntimeError(f"math-verify worker cannot start: {msg.get('err')}")
        self.ready = True

    def verify(self, gold: str, pred: str, timeout_s: float) -> bool:
        soft = timeout_s * _SOFT_DEADLINE_FRACTION if _SOFT_DEADLINE_FRACTION else None
        data = (json.dumps({"g": gold, "p": pred, "soft": soft}) + "\n").encode("ascii")
        deadline = time.monotonic() + timeout_s
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view) :]
        except OSError as e:  # BrokenPipeError: it died between calls
            raise _WorkerError(f"write failed: {e}") from e
        msg = self._read_message(deadline)
        if msg.get("err"):
            logger.debug("math-verify failed (counted as wrong): %s", msg["err"])
        return msg.get("ok") is True

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # already gone, or a zombie we cannot reap: nothing else to do
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


class _VerifierPool:
    """Up to `max_workers` workers shared by all threads; a timed-out worker is killed and a
    replacement spawned at once (it imports in the background while the caller moves on)."""

    def __init__(self, max_workers: int) -> None:
        self._max = max(1, max_workers)
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._count = 0
        self._closed = False
        self._broken: str | None = None
        self._start_failures = 0

    def _acquire(self) -> _Worker | None:
        with self._cond:
            while not self._idle and self._count >= self._max and not self._closed:
                self._cond.wait()
            if self._closed or self._broken:
                return None
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Worker()
        except Exception:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
            worker = None
            if not self._closed and not self._broken:
                try:
                    worker = _Worker()  # pre-spawn: the next call should not pay the import
                except Exception:
                    logger.debug("cannot respawn math-verify worker", exc_info=True)
        with self._cond:
            if worker is None:
                self._count -= 1
            elif self._closed:
                worker.kill()
                self._count -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _mark_broken(self, reason: str) -> None:
        with self._cond:
            if self._broken is None:
                logger.warning("%s; only exact matches will count as correct", reason)
            self._broken = reason

    def verify(self, gold: str, pred: str, timeout_s: float) -> bool:
        try:
            worker = self._acquire()
        except (FileNotFoundError, PermissionError) as e:  # no usable sys.executable
            self._mark_broken(f"cannot start the math-verify worker: {e!r}")
            return False
        except OSError:  # e.g. out of fds or processes for now: this answer only
            logger.debug("cannot start a math-verify worker; answer counted as wrong", exc_info=True)
            return False
        if worker is None:
            return False
        healthy = False
        try:
            try:
                worker.wait_ready()
            except RuntimeError as e:  # math-verify not importable: say it once, then go exact-only
                self._mark_broken(str(e))
                return False
            except _WorkerError as e:  # crashed or hung while starting
                with self._cond:
                    self._start_failures += 1
                    failures = self._start_failures
                if failures >= _MAX_START_FAILURES:
                    self._mark_broken(f"math-verify worker failed to start {failures} times in a row ({e})")
                raise
            with self._cond:
                self._start_failures = 0
            result = worker.verify(gold, pred, timeout_s)
            healthy = True
            return result
        except _WorkerError as e:
            logger.debug("math-verify worker killed (%s); answer counted as wrong", e)
            return False
        finally:
            self._release(worker, healthy)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's workers without touching them."""
        for w in self._idle:
            for f in (w.proc.stdin, w.proc.stdout):
                try:
                    f.close()
                except Exception:
                    pass
        self._idle = []


_POOL: _VerifierPool | None = None
_POOL_LOCK = threading.Lock()


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


def _get_pool() -> _VerifierPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _VerifierPool(_default_workers())
        return _POOL


def _shutdown_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def _after_fork_in_child() -> None:
    global _POOL, _POOL_LOCK
    _POOL_LOCK = threading.Lock()  # may have been held by another thread at fork time
    if _POOL is not None:
        _POOL.forget_after_fork()
    _POOL = None


atexit.register(_shutdown_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _as_math_verify_latex(s: str) -> str:
    """Strip the answer's own math delimiters and wrap it once in ``$...$`` for math-verify."""
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    return f"${s.strip()}$"


# ---------------------------------------------------------------------------------------
# Public rewards
# ---------------------------------------------------------------------------------------


def verify_answer(text: str, ground_truth: str, timeout_s: float = 2.0) -> bool:
    """is_equivalent(ŷ, a): does response `text` end with an answer equal to `ground_truth`?

    Exact path first (extract, `normalize_answer`, string equality; two plain decimals that
    differ are final). Otherwise math-verify in a worker subprocess, at most `timeout_s`
    seconds of verification (the worker's start-up, once per process and pre-spawned after
    a kill, and any wait for a free worker when all `DAPO_VERIFY_WORKERS` are busy, are not
    counted). Answers or ground truths longer than MAX_VERIFY_CHARS skip math-verify.
    Timeouts and every error count as False (logged at debug level), never raised.
    Safe from any thread. A non-str ground truth (an int from a data file) is str()-ed.
    """
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    try:
        if not isinstance(text, str) or ground_truth is None:
            return False
        gold = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
        pred = extract_answer(text)
        if pred is None:
            return False
        norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
        if not norm_pred or not norm_gold:
            return False
        if norm_pred == norm_gold:
            return True
        if _PLAIN_NUMBER_RE.fullmatch(norm_pred) and _PLAIN_NUMBER_RE.fullmatch(norm_gold):
            return False  # canonical decimals: different strings are different numbers
        if len(pred) > MAX_VERIFY_CHARS or len(gold) > MAX_VERIFY_CHARS:
            logger.debug("answer too long for math-verify (%d chars): counted as wrong", len(pred))
            return False
        return _get_pool().verify(_as_math_verify_latex(gold), _as_math_verify_latex(pred), float(timeout_s))
    except Exception:
        logger.debug("verify_answer failed; counted as wrong", exc_info=True)
        return False


def correctness_reward(text: str, ground_truth: str) -> float:
    """DAPO's rule-based reward R(ŷ, y) (paper sec. 2.4): +1.0 if equivalent to the ground truth, else -1.0."""
    return 1.0 if verify_answer(text, ground_truth) else -1.0


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


def score_response(
    text: str,
    ground_truth: str,
    response_length: int,
    *,
    max_len: int,
    buffer_len: int,
    overlong_factor: float,
    format_weight: float,
) -> dict[str, float]:
    """Everything the pipeline records for one response y_i.

    reward = R_correct + R_length * overlong_factor + format_weight * format_score
    `acc` (1.0 / 0.0) is what dynamic sampling filters on (std of acc within a group > 0).
    """
    correct = verify_answer(text, ground_truth)
    correctness = 1.0 if correct else -1.0
    penalty = overlong_penalty(response_length, max_len, buffer_len, overlong_factor)
    fmt = format_score(text)
    return {
        "reward": correctness + penalty + format_weight * fmt,
        "acc": 1.0 if correct else 0.0,
        "correctness": correctness,
        "overlong_penalty": penalty,
        "format_score": fmt,
    }
