"""Does scoring a batch of responses in parallel pay? Serial vs parallel, same process.

A batch of mixed responses, G per question sharing its ground truth as in a DAPO step:

    exact        integer answers, right or wrong: decided by string comparison, no worker
    math-verify  LaTeX fractions, decimals and words against fraction ground truths:
                 normalization cannot decide them, so each is a task for a math-verify worker
    no answer    rambling text with no "Answer:" line or box: wrong at once

Both sides score every response and must agree, result for result, in batch order:

    serial       `dapo.rewards.score_response` on one response after the other
    parallel     `dapo.rewards.score_responses` on the batch (what `dapo.execution.stages.scoring.
                 verify_rewards` calls): several responses at a time from threads
                 (2 x workers), so that every math-verify worker has a task

The pool's workers are started before any timing (a worker's start-up is a once-per-
process cost, not per batch). The two sides alternate over the repeats, so a change in
the machine's load hits both alike; the best and the median of each are printed.

    PYTHONPATH=. .venv/bin/python benchmarks/verifier.py [--responses 512] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

SETTINGS = {"max_len": 20480, "buffer_len": 4096, "overlong_factor": 1.0, "format_weight": 0.0}
REASONING = "Let me work through this step by step.\n" * 20


def exact_case(rng: random.Random) -> tuple[str, str]:
    truth = rng.randint(-1000, 100000)
    answer = truth if rng.random() < 0.5 else truth + rng.randint(1, 9)
    return f"{REASONING}Answer: {answer}", str(truth)


def math_verify_case(rng: random.Random) -> tuple[str, str]:
    p, q = rng.randint(1, 9), rng.randint(2, 12)
    truth = f"\\frac{{{p}}}{{{q}}}"
    answer = rng.choice([f"{p}/{q}", f"\\dfrac{{{2 * p}}}{{{2 * q}}}", f"{p / q:.6g}", f"\\frac{{{p + 1}}}{{{q}}}", "\\sqrt{2}", "infinitely many"])
    return f"{REASONING}Answer: ${answer}$", truth


def no_answer_case(rng: random.Random) -> tuple[str, str]:
    return REASONING + "".join(rng.choice("abc xyz{}()=+\n") for _ in range(400)), str(rng.randint(0, 100))


KINDS = {"exact": exact_case, "math-verify": math_verify_case, "no answer": no_answer_case}
MIX = {"exact": 0.5, "math-verify": 0.3, "no answer": 0.2}


def make_batch(n: int, group_size: int = 8, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (kind, response, ground truth) triples; each group of `group_size` shares a kind
    and a ground truth (its responses differ), as the G responses to one question do."""
    rng = random.Random(seed)
    batch = []
    while len(batch) < n:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        _, truth = KINDS[kind](rng)
        for _ in range(min(group_size, n - len(batch))):
            text, _ = KINDS[kind](rng)
            if kind == "math-verify":  # a response to this question: same truth, own answer
                text = text if rng.random() < 0.5 else f"{REASONING}Answer: ${truth}$"
            batch.append((kind, text, truth))
    return batch


def serial(batch) -> list[dict[str, float]]:
    from dapo.rewards import score_response

    return [score_response(text, truth, len(text) // 4, **SETTINGS) for _, text, truth in batch]


def parallel(batch) -> list[dict[str, float]]:
    from dapo.rewards import score_responses

    texts, truths = [text for _, text, _ in batch], [truth for _, _, truth in batch]
    return score_responses(texts, truths, [len(text) // 4 for text in texts], **SETTINGS)


def timed(fn, *args) -> tuple[float, list]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def compare(name: str, batch, repeats: int) -> None:
    """Alternate serial and parallel runs; print responses/s (best, median) side by side."""
    seconds = {"serial": [], "parallel": []}
    for _ in range(repeats):
        t, want = timed(serial, batch)
        seconds["serial"].append(t)
        t, got = timed(parallel, batch)
        seconds["parallel"].append(t)
        assert got == want, "parallel scoring changed a result"
    best = {side: len(batch) / min(s) for side, s in seconds.items()}
    median = {side: len(batch) / statistics.median(s) for side, s in seconds.items()}
    print(
        f"{name:<22} {len(batch):>5}  serial {best['serial']:>8.0f} /s (median {median['serial']:>8.0f})"
        f"  parallel {best['parallel']:>8.0f} /s (median {median['parallel']:>8.0f})"
        f"  speed-up {best['parallel'] / best['serial']:.2f}x (median {median['parallel'] / median['serial']:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2, help="math-verify workers (DAPO_VERIFY_WORKERS)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["DAPO_VERIFY_WORKERS"] = str(args.workers)  # read when dapo.rewards is imported
    from dapo.rewards import verifier_pool

    # Start every worker (each imports math-verify) before timing anything: a worker busy
    # with one sleep takes no other, so when all sleeps are done all workers are up.
    pool = verifier_pool.POOL._running_pool()
    for sleep in [pool.schedule(time.sleep, (1.0,)) for _ in range(args.workers)]:
        sleep.result(timeout=120)

    batch = make_batch(args.responses)
    counts = {kind: sum(1 for k, _, _ in batch if k == kind) for kind in KINDS}
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, workers {args.workers}, threads {2 * args.workers}")
    print("batch: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    compare("mixed batch", batch, args.repeats)
    compare("math-verify only", [item for item in batch if item[0] == "math-verify"], args.repeats)


if __name__ == "__main__":
    main()
