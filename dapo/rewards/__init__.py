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
scorer runs in the verifier's worker processes (verifier_pool), under math-verify's time limit.

Verification order, cheapest first:
  1. extract the answer (last "Answer:" line, else last ``\\boxed{}``); none -> wrong.
  2. `normalize_answer` both sides; equal strings -> right. Both plain decimals but unequal
     -> wrong (canonical decimals are equal iff their strings are). Most DAPO-Math answers
     are integers, so most calls end here in microseconds.
  3. otherwise math-verify (parse + verify) in worker processes under a hard time limit
     (verifier_pool says why in workers, and how a script without a ``__main__`` guard, a
     notebook or a pyflyte task all get them).

A verdict math-verify did not give (its time limit, an error in it, an answer too long for
it) counts as wrong and is marked `unverified` with the reason (`judge_answer`); the pipeline
counts those per step (train/unverified, val/unverified, reward/unverified_share) and stops a
run whose share passes `max_unverified_share`. A worker that dies on a response (a crash in C,
out of memory) is named at WARNING and the response scored once more in a new worker; a
response that kills a second worker raises ScorerError. Workers that cannot start at all raise
`VerifierUnavailable`: the reward never silently becomes an exact-match reward.

Model text is never evaluated as code: only string operations here, and math-verify's
parser (ANTLR LaTeX grammar / sympy's restricted parse_expr) in the worker.

Nothing here imports flytekit; the package is safe to import from any thread or process.
"""

from dapo.rewards.extraction import (
    ANSWER_SCAN_CHARS,
    BOXED_SCAN_CHARS,
    MAX_BOXED_CANDIDATES,
    MAX_BOXED_CHARS,
    MAX_BRACE_DEPTH,
    MAX_VERIFY_CHARS,
    extract_answer,
    normalize_answer,
)
from dapo.rewards.scorers import (
    RESERVED_SCORE_KEYS,
    SCORERS,
    Scorer,
    TaskScore,
    Verdict,
    dapo_math,
    format_reward_weight,
    format_score,
    judge_answer,
    last_number_matches,
    overlong_penalty,
    reasoning_gym,
    register_scorer,
    score_response,
    score_responses,
    task_score,
    verify_answer,
)
from dapo.rewards.verifier_pool import ScorerError, VerifierUnavailable

__all__ = [
    "ANSWER_SCAN_CHARS",
    "BOXED_SCAN_CHARS",
    "MAX_BOXED_CHARS",
    "MAX_BRACE_DEPTH",
    "MAX_BOXED_CANDIDATES",
    "MAX_VERIFY_CHARS",
    "RESERVED_SCORE_KEYS",
    "last_number_matches",
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
