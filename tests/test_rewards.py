"""Tests for dapo.rewards: DAPO's rule reward, soft overlong punishment and format reward."""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapo import rewards
from dapo.rewards import extraction, scorers, verifier_pool
from dapo.rewards import (
    extract_answer,
    format_reward_weight,
    format_score,
    normalize_answer,
    overlong_penalty,
    score_response,
    score_responses,
    verify_answer,
)

# Slack for process scheduling on a loaded CI box, on top of the call's own time limit.
MARGIN_S = 1.0
REASONING = "Let me think step by step. We have x + 1 = 2, so x = 1.\n" * 40


@pytest.fixture(scope="module", autouse=True)
def warm_worker():
    """Start the math-verify worker once, so timing asserts measure verification, not imports."""
    assert verify_answer("Answer: 1/2", "0.5")
    yield


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


# --------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (16384, 0.0),  # exactly L_max - L_cache: no penalty yet
        (16385, -1 / 4096),  # first token inside the buffer
        (18432, -0.5),  # middle of the buffer
        (20479, -4095 / 4096),
        (20480, -1.0),  # exactly L_max: the whole buffer used
        (20481, -1.0),  # beyond L_max
        (10**9, -1.0),
    ],
)
def test_overlong_paper_defaults(length, expected):
    assert overlong_penalty(length, max_len=20480, buffer_len=4096) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "length, expected",
    [(5, 0.0), (6, 0.0), (7, -0.125), (8, -0.25), (9, -0.375), (10, -0.5), (11, -0.5)],
)
def test_overlong_small_hand_computed_with_factor(length, expected):
    # L_max=10, L_cache=4, factor 0.5: penalty ((10-4) - |y|) / 4 * 0.5 inside (6, 10].
    assert overlong_penalty(length, 10, 4, factor=0.5) == pytest.approx(expected)


def test_overlong_zero_buffer_is_a_hard_step():
    assert overlong_penalty(100, 100, 0) == 0.0
    assert overlong_penalty(101, 100, 0) == -1.0
    assert overlong_penalty(101, 100, 0, factor=2.0) == -2.0


def test_overlong_full_buffer():
    # buffer_len == max_len: every token counts, linear from 0 to -1.
    assert overlong_penalty(0, 8, 8) == 0.0
    assert overlong_penalty(2, 8, 8) == pytest.approx(-0.25)
    assert overlong_penalty(8, 8, 8) == -1.0


@pytest.mark.parametrize(
    "args, bad",
    [
        ((10, 100, 101), "buffer_len"),
        ((10, 100, -1), "buffer_len"),
        ((-1, 100, 10), "length"),
        ((10, 0, 0), "max_len"),
        ((10, -5, 0), "max_len"),
        ((10, 100, 10, -1.0), "factor"),
        ((10, 100, 10, float("nan")), "factor"),
    ],
)
def test_overlong_rejects_bad_arguments(args, bad):
    with pytest.raises(ValueError, match=bad):
        overlong_penalty(*args)


@settings(max_examples=200, deadline=None)
@given(
    max_len=st.integers(1, 50_000),
    frac=st.floats(0, 1),
    factor=st.floats(0, 10),
    a=st.integers(0, 60_000),
    b=st.integers(0, 60_000),
)
def test_overlong_bounded_and_monotone(max_len, frac, factor, a, b):
    buffer_len = int(frac * max_len)
    pa = overlong_penalty(a, max_len, buffer_len, factor)
    pb = overlong_penalty(b, max_len, buffer_len, factor)
    assert -factor - 1e-9 <= pa <= 0.0
    if a <= b:
        assert pb <= pa + 1e-12


# --------------------------------------------------------------------------- format


def test_format_weight_linear_decay():
    assert format_reward_weight(0, 100) == 1.0
    assert format_reward_weight(25, 100) == pytest.approx(0.75)
    assert format_reward_weight(50, 100) == pytest.approx(0.5)
    assert format_reward_weight(99, 100) == pytest.approx(0.01)
    assert format_reward_weight(100, 100) == 0.0
    assert format_reward_weight(1000, 100) == 0.0
    assert format_reward_weight(10, 20, initial_weight=0.4) == pytest.approx(0.2)


def test_format_weight_zero_decay_steps_means_off():
    assert format_reward_weight(0, 0) == 0.0
    assert format_reward_weight(5, 0, initial_weight=3.0) == 0.0


@pytest.mark.parametrize("args", [(-1, 10), (0, -1)])
def test_format_weight_rejects_negative(args):
    with pytest.raises(ValueError):
        format_reward_weight(*args)


@pytest.mark.parametrize(
    "text, expected",
    [
        (REASONING + "Answer: 42", 1.0),
        (REASONING + "Answer: 42\n\n  ", 1.0),  # trailing blank lines are fine
        (REASONING + "**Answer:** $\\frac{1}{2}$", 1.0),
        (REASONING + "answer: 7", 1.0),
        (REASONING + "Answer: 42\nHope this helps!", 0.0),  # not the final line
        (REASONING + "Answer:", 0.0),  # empty answer
        (REASONING + "Answer:   **", 0.0),
        (REASONING + "The answer is \\boxed{42}", 0.0),  # boxed is not the asked layout
        ("", 0.0),
        ("Answer: " + "9" * 10_000, 0.0),  # final line longer than the scan window
    ],
)
def test_format_score(text, expected):
    assert format_score(text) == expected


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 42", "42"),
        (REASONING + "Answer: 42\n", "42"),
        ("  **Answer:** 17", "17"),
        ("**Answer: 17**", "17"),
        ("## Final Answer: $3$", "$3$"),
        ("ANSWER: -5", "-5"),
        ("Answer: 3\nWait, let me recheck.\nAnswer: 4\nAnswer: 5\n", "5"),  # last line wins
        ("Answer: 3\nAnswer:\n", "3"),  # an empty Answer line is skipped
        ("The Answer: 3 is not at the line start", None),
        ("so the result is \\boxed{12}.", "12"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # last box
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed {7}", "7"),
        ("\\fbox{8}", "8"),
        ("$\\boxed 9$", "9"),
        ("\\boxed{1} and a truncated \\boxed{\\frac{2}{", "1"),  # unbalanced last box
        ("\\boxedx{1}", None),
        ("Answer: 5\n\\boxed{6}", "5"),  # the Answer line has priority
        ("Answer:\n\\boxed{9}", "9"),
        ("no answer here", None),
        ("", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_only_scans_the_tail():
    far = "Answer: 1\n" + "x" * (extraction.ANSWER_SCAN_CHARS + 10)
    assert extract_answer(far) is None
    near = "Answer: 1\n" + "x" * (extraction.ANSWER_SCAN_CHARS - 100)
    assert extract_answer(near) == "1"


# --------------------------------------------------------------------------- normalization


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("42", "42"),
        (" $42$ ", "42"),
        ("\\$12", "12"),
        ("12 dollars", "12"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("1\\,000", "1000"),
        ("12,345.50", "12345.5"),
        ("1,2", "1, 2"),  # a list, not a thousands separator
        ("1, 234", "1, 234"),
        ("42.", "42"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "(1, 2)"),
        ("5 cm", "5"),
        ("5\\text{ cm}", "5"),
        ("5 \\mbox{cm}^2", "5"),
        ("12 sq units", "12"),
        ("5m", "5m"),  # a bare single letter may be a product: kept
        ("5 m", "5"),
        ("30^\\circ", "30"),
        ("30^{\\circ}", "30"),
        ("30°", "30"),
        ("10\\%", "10"),
        ("x = 5", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\u22125", "-5"),  # unicode minus
        ("-007.50", "-7.5"),
        ("+3", "3"),
        ("-0", "0"),
        ("\\text{yes}", "yes"),
        ("\\sqrt2", "\\sqrt{2}"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# --------------------------------------------------------------------------- verification


@pytest.mark.parametrize(
    "text, gt",
    [
        ("Answer: 42", "42"),
        (REASONING + "Answer: $42$.", "42"),
        ("Answer: \\frac{1}{2}", "0.5"),
        ("Answer: 0.5", "\\frac{1}{2}"),
        ("Answer: 1/2", "\\frac{1}{2}"),
        ("Answer: $\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: $\\dfrac{3}{4}$", "0.75"),
        ("Answer: 1,000", "1000"),
        ("Answer: \\$1,000.", "1000"),
        ("Answer: 5 cm", "5"),
        ("Answer: $5\\text{ cm}$", "5"),
        ("Answer: 12 dollars", "12"),
        ("Answer: 12 ways", "12"),  # count noun: math-verify's job
        ("Answer: -3", "-3"),
        ("Answer: $-\\frac{2}{3}$", "-\\frac{2}{3}"),
        ("Answer: 3\nHmm, no.\nAnswer: 4", "4"),
        ("we get \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("so \\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
        ("Answer: x = 5", "5"),
        ("Answer: 2", 2),  # ground truth stored as an int
    ],
)
def test_verify_true(text, gt):
    assert verify_answer(text, gt) is True


@pytest.mark.parametrize(
    "text, gt",
    [
        ("Answer: 12", "21"),
        ("Answer: 1/2", "2"),
        ("Answer: \\frac{1}{2}", "2"),
        ("Answer: -5", "5"),
        ("Answer: 5", "-5"),
        ("Answer: 3\nAnswer: 4", "3"),  # only the last answer counts
        ("Answer: 1,2", "12"),
        ("Answer: 12.0000001", "12"),
        ("The result is 42 but I never say it in the asked form", "42"),  # nothing extracted
        ("", "42"),
        ("Answer: 42", ""),
        ("Answer: \\text{five}", "5"),
        ("Answer: \\sqrt{2}", "2"),
        # hedging must not pay: several candidates are not an answer
        ("Answer: 5 or 6", "5"),
        ("Answer: 5 or 6", "6"),
        ("Answer: $5$ or $6$", "5"),
        ("Answer: 4, 5", "5"),
        ("Answer: 1,2,3,4,5", "5"),
    ],
)
def test_verify_false(text, gt):
    assert verify_answer(text, gt) is False


def test_verify_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        verify_answer("Answer: 1", "1", timeout_s=0)


def test_verify_non_string_inputs_are_false():
    assert verify_answer(None, "1") is False  # type: ignore[arg-type]
    assert verify_answer("Answer: 1", None) is False  # type: ignore[arg-type]


def test_verify_from_a_non_main_thread():
    results: dict[str, bool] = {}

    def run():
        results["mv"] = verify_answer("Answer: 0.25", "\\frac{1}{4}")  # math-verify path
        results["exact"] = verify_answer("Answer: 7", "7")
        results["wrong"] = verify_answer("Answer: \\frac{1}{3}", "3")

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert results == {"mv": True, "exact": True, "wrong": False}


def test_verify_concurrent_threads():
    cases = [(f"Answer: \\frac{{1}}{{{k}}}", str(1 / k), True) for k in (2, 4, 5, 8)]
    cases += [(f"Answer: \\frac{{1}}{{{k}}}", str(k), False) for k in (2, 4, 5, 8)]
    out: list[tuple[bool, bool]] = []
    lock = threading.Lock()

    def run(text, gt, want):
        got = verify_answer(text, gt)
        with lock:
            out.append((got, want))

    threads = [threading.Thread(target=run, args=c) for c in cases * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(out) == len(cases) * 2
    assert all(got == want for got, want in out)


# --------------------------------------------------------------------------- adversarial


def _junk(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


ADVERSARIAL = {
    "1MB of prose": "word " * 200_000,
    "1MB then an answer": "word " * 200_000 + "\nAnswer: 42",
    "1MB of {": "{" * (1 << 20),
    "1MB of \\boxed{": "\\boxed{" * 150_000,
    "100k nested braces in a box": "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}",
    "100k open braces in a box at the end": "x\n\\boxed{" + "{" * 100_000,
    "Answer: huge LaTeX": "Answer: " + "\\frac{1}{" * 50_000 + "2" + "}" * 50_000,
    "Answer: huge LaTeX under the scan window": "Answer: $" + "\\sqrt{" * 300 + "2" + "}" * 300 + "$",
    "Answer: 600 nested parens (slow sympy parse)": "Answer: $" + "(" * 300 + "1" + ")" * 300 + "$",
    "Answer: tower of powers": "Answer: $9^{9^{9}}$",
    "Answer: huge factorial": "Answer: $(10^{6})!$",
    "binary junk latin-1": _junk(1 << 20, 0).decode("latin-1"),
    "binary junk surrogateescape + answer": _junk(1 << 16, 1).decode("utf-8", "surrogateescape")
    + "\nAnswer: "
    + _junk(200, 2).decode("utf-8", "surrogateescape").replace("\n", " "),
    "NUL bytes": "\x00" * 100_000 + "\nAnswer: \x00\x00",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_returns_bool_within_limit(name):
    text = ADVERSARIAL[name]
    limit = 0.5
    got, elapsed = timed(verify_answer, text, "5", timeout_s=limit)
    assert isinstance(got, bool)
    assert got is False
    assert elapsed < limit + MARGIN_S, f"{name}: {elapsed:.2f}s"
    # the helpers must be just as robust
    _, t_extract = timed(extract_answer, text)
    _, t_format = timed(format_score, text)
    assert t_extract < 0.2 and t_format < 0.2


def test_hard_kill_when_worker_cannot_interrupt_itself(monkeypatch):
    # Without the worker's own soft deadline, only the caller's hard kill can stop it.
    monkeypatch.setattr(verifier_pool, "_SOFT_DEADLINE_FRACTION", None)
    got, elapsed = timed(verify_answer, "Answer: $" + "(" * 300 + "1" + ")" * 300 + "$", "5", timeout_s=0.3)
    assert got is False
    assert elapsed < 0.3 + MARGIN_S
    monkeypatch.undo()
    # the pool recovers: a replacement worker answers the next call
    assert verify_answer("Answer: 0.2", "\\frac{1}{5}") is True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_verify_never_raises_on_arbitrary_answers(s):
    t0 = time.monotonic()
    assert isinstance(verify_answer("Answer: " + s, "12", timeout_s=0.5), bool)
    assert isinstance(verify_answer(s, s, timeout_s=0.5), bool)
    assert time.monotonic() - t0 < 2 * (0.5 + MARGIN_S)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(list("0123456789.,-+ $\\{}()^=xcm%") + ["\\frac", "\\text{ cm}", "\\boxed", "\\left("]),
        max_size=30,
    ).map("".join)
)
def test_normalize_is_idempotent_and_total(s):
    once = normalize_answer(s)
    assert normalize_answer(once) == once


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12))
def test_integers_in_any_common_dress_verify_exactly(n):
    formatted = f"{n:,}"
    for text in (f"Answer: {n}", f"Answer: ${n}$.", f"Answer: {formatted}", f"\\boxed{{{n}}}"):
        assert verify_answer(text, str(n)) is True
    assert verify_answer(f"Answer: {n + 1}", str(n)) is False


# --------------------------------------------------------------------------- score_response


def test_score_response_correct_inside_buffer_with_format():
    out = score_response(
        REASONING + "Answer: 42",
        "42",
        18432,
        max_len=20480,
        buffer_len=4096,
        overlong_factor=1.0,
        format_weight=0.5,
    )
    assert set(out) == {"reward", "acc", "score", "overlong_penalty", "format_score", "unverified", "verdict_note", "score_metrics"}
    assert out["acc"] == 1.0 and out["score"] == 1.0
    assert out["overlong_penalty"] == pytest.approx(-0.5)
    assert out["format_score"] == 1.0
    assert out["reward"] == pytest.approx(1.0 - 0.5 + 0.5)


def test_score_response_wrong_truncated_no_format():
    out = score_response(
        REASONING + "and so on",
        "42",
        20480,
        max_len=20480,
        buffer_len=4096,
        overlong_factor=1.0,
        format_weight=1.0,
    )
    assert out == {"reward": -2.0, "acc": 0.0, "score": -1.0, "overlong_penalty": -1.0, "format_score": 0.0, "unverified": 0.0,
                   "verdict_note": "", "score_metrics": {}}


def test_score_response_paper_setting_ignores_format():
    out = score_response("\\boxed{7}", "7", 10, max_len=100, buffer_len=20, overlong_factor=1.0, format_weight=0.0)
    assert out["reward"] == 1.0 and out["format_score"] == 0.0 and out["acc"] == 1.0


def test_score_responses_is_score_response_in_batch_order():
    texts = ["Answer: 12", "Answer: \\frac{1}{2}", "no answer", "Answer: 0.5", "Answer: 13", "\\boxed{\\sqrt{8}}"] * 4
    truths = ["12", "0.5", "3", "\\frac{1}{2}", "12", "2\\sqrt{2}"] * 4
    lengths = list(range(0, 240, 10))
    settings = {"max_len": 200, "buffer_len": 50, "overlong_factor": 1.0, "format_weight": 0.5}
    want = [score_response(t, g, n, **settings) for t, g, n in zip(texts, truths, lengths)]
    assert score_responses(texts, truths, lengths, **settings) == want
    assert [w["acc"] for w in want[:6]] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_worker_is_a_separate_process():
    # verify_answer must not run math-verify (or its signal.alarm) in the caller's process.
    assert verify_answer("Answer: 0.125", "\\frac{1}{8}")
    worker_pid = verifier_pool.POOL._running_pool().schedule(os.getpid).result(timeout=30)
    assert worker_pid != os.getpid()


@pytest.mark.parametrize(
    "start_worker",
    [
        functools.partial(importlib.import_module, "no_such_math_verify"),  # math-verify not importable
        functools.partial(sys.exit, 3),  # dies before taking a task
    ],
)
def test_a_verifier_whose_workers_cannot_start_raises_instead_of_degrading_to_exact_matching(monkeypatch, start_worker):
    monkeypatch.setattr(verifier_pool, "_start_worker", start_worker)
    monkeypatch.setattr(verifier_pool, "POOL", verifier_pool._VerifierPool(2))
    assert verify_answer("Answer: 1,000", "1000") is True  # the exact path needs no worker
    for _ in range(2):  # and every later call says so too
        with pytest.raises(rewards.VerifierUnavailable, match="failed to start 3 times in a row"):
            verify_answer("Answer: 1/2", "0.5")  # needs math-verify
    with pytest.raises(rewards.VerifierUnavailable):
        score_response("Answer: 1/2", "0.5", 4, max_len=10, buffer_len=2, overlong_factor=1.0, format_weight=0.0)


def test_a_verdict_math_verify_did_not_give_counts_as_wrong_and_is_marked_unverified(monkeypatch):
    monkeypatch.setattr(verifier_pool, "_SOFT_DEADLINE_FRACTION", None)  # only the hard kill stops it
    slow = "Answer: $" + "(" * 300 + "1" + ")" * 300 + "$"
    no_verdict = rewards.Verdict(correct=False, unverified=True, note="math-verify gave no verdict within 0.3 s")
    assert rewards.judge_answer(slow, "5", timeout_s=0.3) == no_verdict
    monkeypatch.undo()
    assert rewards.judge_answer(slow, "5", timeout_s=0.3) == no_verdict  # soft deadline
    too_long = rewards.judge_answer("Answer: " + "1+" * 600 + "1", "5")
    assert too_long.unverified and too_long.note == "answer of 1201 chars, over math-verify's 1024"
    assert rewards.judge_answer("Answer: 1/2", "0.5") == rewards.Verdict(correct=True, unverified=False)
    assert rewards.judge_answer("Answer: 3/4", "0.5") == rewards.Verdict(correct=False, unverified=False)
    assert rewards.judge_answer("no answer here", "0.5") == rewards.Verdict(correct=False, unverified=False)
    settings = {"max_len": 10, "buffer_len": 2, "overlong_factor": 1.0, "format_weight": 0.0}
    assert [s["unverified"] for s in score_responses([slow, "Answer: 5"], ["5", "5"], [4, 4], **settings)] == [1.0, 0.0]


def test_a_math_verify_exception_is_unverified_with_its_message_shown_once_at_warning(monkeypatch, caplog):
    import math_verify

    def broken_verify(*args, **kwargs):
        raise ValueError("sympy could not compare")

    monkeypatch.setattr(math_verify, "verify", broken_verify)
    assert verifier_pool.math_verify("$1/2$", "$0.5$") == "ValueError: sympy could not compare"  # as the worker returns it
    monkeypatch.setattr(verifier_pool.POOL, "run", lambda task, args, timeout_s, what: verifier_pool.math_verify(*args))
    monkeypatch.setattr(scorers, "_warned", set())
    verdicts = [rewards.judge_answer(f"Answer: {p}", "0.5") for p in ("1/2", "2/4", "3/6")]
    assert verdicts[0] == rewards.Verdict(False, unverified=True, note="math-verify raised ValueError: sympy could not compare")
    assert all(v.unverified and not v.correct for v in verdicts)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "math-verify raised" in r.getMessage()]
    assert len(warnings) == 1 and "'1/2'" in warnings[0].getMessage() and "sympy could not compare" in warnings[0].getMessage()


UNGUARDED_SCRIPT = r"""
import json
from dapo.rewards import verify_answer
cases = [("1/2", "\\frac{1}{2}"), ("0.5", "\\frac{1}{2}"), ("\\frac{3}{4}", "0.75"), ("2\\sqrt{2}", "\\sqrt{8}"),
         ("\\frac{1}{3}", "0.5")]
print("VERDICTS", json.dumps([verify_answer(f"Answer: {p}", g) for p, g in cases]))
"""


def test_a_script_without_a_main_guard_gets_math_verify_verdicts(tmp_path):
    """multiprocessing's spawn re-runs an unguarded __main__ in each worker, whose own first
    verify_answer then fails to start a process: the workers must not re-run it."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("VERDICTS")] == ["VERDICTS [true, true, true, true, false]"]
    assert "bootstrapping phase" not in proc.stderr


def test_long_task_worked_solutions_are_credited_and_grow_with_the_operands():
    """The long embedded task's warm-start solutions, concise and wordy, score as correct,
    and their length grows faster than the operand count (the overlong regime)."""
    import random

    from dapo.data.prompts import CHAIN_LEVELS, chain_problem
    from dapo.model.policy import chain_response_text
    from dapo.rewards import score_responses

    rng = random.Random(0)
    lengths = {}
    for level in range(len(CHAIN_LEVELS)):
        problem, answer = chain_problem(rng, level)
        texts = [chain_response_text(problem, answer), chain_response_text(problem, answer, verbose=True)]
        assert texts[0].splitlines()[-2] == f"= {answer}" and texts[1].splitlines()[-2] == f"So the sum is {answer}."
        scores = score_responses(texts, [answer, answer], [len(t) for t in texts], max_len=10_000, buffer_len=0,
                                 overlong_factor=0.0, format_weight=0.0)
        assert [s["acc"] for s in scores] == [1.0, 1.0]
        lengths[CHAIN_LEVELS[level]] = [len(t) for t in texts]
    assert all(short < wordy for short, wordy in lengths.values())
    assert lengths[7][0] > 4 * lengths[3][0]
