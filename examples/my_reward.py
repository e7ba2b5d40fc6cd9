"""A reward of your own, in one file: DAPO's +1 / -1 on integer answers, and two metrics
of its own (train/score/parsed, train/score/distance in MLflow).

    pyflyte run workflows/dapo.py dapo_loop --set reward.reward_fn=examples/my_reward.py:score

A scorer gets the response text, the data row's ground truth and its extra_info (with
its data_source), and returns a score, or a dict with "score" and any metrics; "acc" (1 / 0),
what dynamic sampling filters on, is score > 0 unless given. It runs in the verifier's
worker processes, under reward.reward_timeout_seconds a response.
"""

from dapo.rewards import extract_answer


def score(response: str, ground_truth: str, extra_info: dict) -> dict[str, float]:
    answer = extract_answer(response)
    try:
        distance = abs(int(answer) - int(ground_truth))
    except (TypeError, ValueError):  # no answer, or not an integer
        return {"score": -1.0, "parsed": 0.0}
    return {"score": 1.0 if distance == 0 else -1.0, "parsed": 1.0, "distance": float(distance)}
