"""The real-model preset's learning curve: smollm2_cpu (SmolLM2-135M-Instruct, Q4_1 dequantized,
on reasoning-gym's chain_sum), one seed an invocation, each appended to a results file.

    PYTHONPATH=. .venv/bin/python benchmarks/real_curve.py --seed 1   # `make run-real` at seed 1, appended
    PYTHONPATH=. .venv/bin/python benchmarks/real_curve.py --table    # the table of every recorded seed

A seed is `pyflyte run workflows/dapo.py dapo_loop --preset smollm2_cpu --set algorithm.seed=N`
with the local cache off (so its wall time is a first run's, the GGUF conversion included) and
an MLflow database of its own, from which its figures are read: validation accuracy, format
rate and last-number accuracy at each validation, and the training clock there (the steps'
generation, scoring and update seconds, summed; validations are outside it). The table holds
the preset's target: validation accuracy at least start + 0.10 within 30 minutes of training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dapo.report import STEP_PARTS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "smollm2_curve.jsonl"
TARGET_GAIN = 0.10
TARGET_TRAIN_MINUTES = 30.0


def run_seed(seed: int, work: Path) -> float:
    """dapo_loop on smollm2_cpu at `seed`, its MLflow database in work; returns its wall seconds."""
    env = {**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    command = [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/dapo.py", "dapo_loop", "--preset", "smollm2_cpu",
               "--set", f"algorithm.seed={seed}", "--mlflow_tracking_uri", f"sqlite:///{work / 'mlflow.db'}",
               "--model_name", f"smollm2-seed{seed}"]
    started = time.perf_counter()
    with open(work / "run.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"seed {seed}: dapo_loop failed (exit {result.returncode}); see {work / 'run.log'}")
    return time.perf_counter() - started


def figures(tracking_uri: str, seed: int, wall_seconds: float) -> dict:
    """One seed's figures from its MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            history.setdefault(point.step, {})[key] = point.value
    if not wall_seconds:  # a run recorded afterwards: from its MLflow run's start to its last metric
        last = max(point.timestamp for key in run.data.metrics for point in client.get_metric_history(run.info.run_id, key))
        wall_seconds = (last - run.info.start_time) / 1000
    clock, validations = 0.0, []
    for step in sorted(history):
        clock += sum(history[step].get(key, 0.0) for key, _ in STEP_PARTS)
        if "val/acc" in history[step]:
            validations.append({"step": step, "train_minutes": clock / 60, "acc": history[step]["val/acc"],
                                "format": history[step]["val/format_score"], "last_number": history[step].get("val/score/last_number")})
    steps = [h for h in history.values() if "policy_step/seconds" in h]
    mean = lambda key: statistics.fmean(h.get(key, 0.0) for h in steps)  # noqa: E731
    return {"seed": seed, "wall_seconds": wall_seconds, "validations": validations,
            "step_seconds": {"generation": mean("rollout/seconds"), "scoring": mean("reward/seconds"), "update": mean("policy_step/seconds")},
            "kept_ratio": mean("sampling/kept_ratio"), "skipped_steps": sum(h.get("step/skipped", 0.0) for h in steps),
            "date": time.strftime("%Y-%m-%d")}


def table(records: list[dict]) -> None:
    """Per validation step: each seed's accuracy, the mean accuracy, format rate and last-number
    accuracy; then each seed against the target."""
    records = sorted({r["seed"]: r for r in records}.values(), key=lambda r: r["seed"])  # a seed's newest record
    steps = sorted({v["step"] for r in records for v in r["validations"]})
    by_seed = [{v["step"]: v for v in r["validations"]} for r in records]
    print(f"{'step':>4} {'train min':>9} " + " ".join(f"{'seed ' + str(r['seed']):>7}" for r in records)
          + f" {'mean':>6} {'format':>6} {'last#':>6}")
    for step in steps:
        points = [s[step] for s in by_seed if step in s]
        print(f"{step:>4} {statistics.fmean(p['train_minutes'] for p in points):>9.1f} "
              + " ".join(f"{s[step]['acc'] if step in s else float('nan'):>7.3f}" for s in by_seed)
              + f" {statistics.fmean(p['acc'] for p in points):>6.3f} {statistics.fmean(p['format'] for p in points):>6.3f}"
              + f" {statistics.fmean(p['last_number'] or 0.0 for p in points):>6.3f}")
    for record, seen in zip(records, by_seed):
        start = seen[min(seen)]["acc"]
        in_time = [v for v in seen.values() if v["train_minutes"] <= TARGET_TRAIN_MINUTES]
        best = max(in_time, key=lambda v: v["acc"])
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in record["step_seconds"].items())
        met = best["acc"] >= start + TARGET_GAIN
        print(f"seed {record['seed']}: {start:.3f} -> best {best['acc']:.3f} at step {best['step']} ({best['train_minutes']:.1f} training min): "
              f"{'meets' if met else 'MISSES'} start + {TARGET_GAIN}; a step {sum(record['step_seconds'].values()):.1f} s ({parts}), "
              f"kept ratio {record['kept_ratio']:.2f}, wall {record['wall_seconds'] / 60:.1f} min ({record['date']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="run this seed and append its figures")
    parser.add_argument("--record", default="", help="append the figures of a run already made (its MLflow tracking URI), with --seed")
    parser.add_argument("--wall-seconds", type=float, default=0.0,
                        help="with --record: that run's wall time (0: from its MLflow run's start to its last metric)")
    parser.add_argument("--table", action="store_true", help="print the table of the recorded seeds")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    results = Path(args.results)
    if args.seed is not None:
        if args.record:
            record = figures(args.record, args.seed, args.wall_seconds)
        else:
            with tempfile.TemporaryDirectory(prefix=f"smollm2-seed{args.seed}-") as tmp:
                wall = run_seed(args.seed, Path(tmp))
                record = figures(f"sqlite:///{Path(tmp) / 'mlflow.db'}", args.seed, wall)
        results.parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as out:
            out.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    if args.table or args.seed is None:
        if not results.exists():
            raise SystemExit(f"{results}: no seed recorded yet (run with --seed N)")
        table([json.loads(line) for line in results.read_text().splitlines() if line.strip()])


if __name__ == "__main__":
    main()
