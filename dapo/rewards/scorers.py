"""The reward of one response: the task's verdict (judge_answer, the scorers registry,
a user's scorer in a worker), DAPO's soft overlong punishment and the optional format term,
combined per response by score_response and per batch by score_responses."""

from __future__ import annotations

import logging
import math
import numbers
import re
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dapo.plugins import is_user_spec, load_user_function
from dapo.plugins import resolve as resolve_plugin
from dapo.rewards import verifier_pool
from dapo.rewards.extraction import (
    ANSWER_SCAN_CHARS,
    MAX_VERIFY_CHARS,
    PLAIN_NUMBER_RE,
    answer_line_content,
    extract_answer,
    normalize_answer,
    tail_lines,
)
from dapo.rewards.verifier_pool import ScorerError

logger = logging.getLogger(__name__)

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
    if PLAIN_NUMBER_RE.fullmatch(norm_pred) and PLAIN_NUMBER_RE.fullmatch(norm_gold):
        return Verdict(False)  # canonical decimals: different strings are different numbers
    if len(pred) > MAX_VERIFY_CHARS or len(gold) > MAX_VERIFY_CHARS:
        return Verdict(
            False,
            unverified=True,
            note=f"answer of {max(len(pred), len(gold))} chars, over math-verify's {MAX_VERIFY_CHARS}",
        )
    ok = verifier_pool.POOL.run(
        verifier_pool.math_verify,
        (verifier_pool.as_math_verify_latex(gold), verifier_pool.as_math_verify_latex(pred)),
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
    lines = tail_lines(stripped, ANSWER_SCAN_CHARS)
    if not lines:
        return 0.0
    return 1.0 if answer_line_content(lines[-1]) else 0.0


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
    (dapo.data.gym_tasks). Correct iff that score is >= 1.0: many tasks give partial credit to an
    answer that merely contains the truth ("the answer is 7" for 7), which must not reward
    padding. R_task = +1 / -1 from it; the task's raw score (`rg_score`) and whether the last
    number of the response is the answer (`last_number`) are logged beside it."""
    from dapo.data.gym_tasks import entry_of

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
    outcome = verifier_pool.POOL.run(
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

    with ThreadPoolExecutor(2 * verifier_pool.POOL.max_workers) as threads:
        return list(threads.map(one, range(n)))
