"""What several benchmarks share: the embedded starting point and a local dapo_loop run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dapo.memory import resident_gib

REPO = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a benchmark's worker process: the repo importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}


def chosen(option: str, allowed, what: str) -> list[str]:
    """A comma-separated option's names, each checked against allowed."""
    names = option.split(",")
    unknown = set(names) - set(allowed)
    if unknown:
        raise SystemExit(f"unknown {what} {sorted(unknown)}; choose from {list(allowed)}")
    return names


def peak_rss_mib() -> float:
    return resident_gib()[1] * 1024


def rss_mib() -> float:
    """This process's resident memory now."""
    return resident_gib()[0] * 1024


RESULT_PREFIX = "RESULT "


def print_result(result: dict) -> None:
    """A worker process's figures, as the line its parent reads (read_result)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def read_result(stdout: str) -> dict | None:
    """The figures a worker printed last (print_result), None if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def run_worker(command: list[str], what: str, env: dict[str, str] | None = None, log: Path | None = None) -> dict:
    """Run a benchmark's worker process (by default with child_env) and return its figures;
    log, if given, gets its whole output. A failed worker ends the benchmark, naming `what`
    and showing the end of its output."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env or child_env(), cwd=REPO)
    if log is not None:
        log.write_text(proc.stdout + "\n" + proc.stderr)
    result = read_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{what} failed (exit {proc.returncode})" + (f"; full log: {log}" if log else ""))
    return result


def prepare_start(work: Path) -> None:
    """The embedded data and the warm-started tiny policy under work/ (kept for reuse)."""
    from dapo import checkpoint
    from dapo.execution.stages import setup
    from dapo.config import DAPOConfig

    if checkpoint.is_complete(work / "policy-0") and (work / "data" / setup.VAL_FILE).exists():
        print(f"reusing the data and starting policy in {work}", flush=True)
        return
    config = DAPOConfig.tiny_cpu()
    print("preparing the embedded data and the warm-started tiny policy (about 2 minutes) ...", flush=True)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")


def run_dapo_loop(
    work: Path, steps: int, overrides: dict, name: str, steps_per_chunk: int = 0, curve: list | None = None,
    preset: str = "tiny_cpu",
) -> tuple[str, list[dict], float]:
    """dapo_loop of `preset` from work/'s starting point (policy-0, data/), executed locally
    by flytekit with caching off (steps_per_chunk: 0 = the preset's).

    Returns the final checkpoint path, the metric history and the seconds spent in
    validation (validation.evaluate), which benchmarks of the step loop leave out. curve, if
    given, gets one point per validation: {"step", "train_seconds" (the run's seconds so
    far, validation left out), "val/acc"}.
    """
    os.environ["FLYTE_LOCAL_CACHE_ENABLED"] = "false"
    from dapo.execution.stages import setup, validation
    from dapo.tracking import run_history
    from workflows.dapo import dapo_loop

    evaluate = validation.evaluate
    eval_seconds = 0.0
    run_started = time.perf_counter()

    def timed_evaluate(config, policy_dir, data_dir, step, *args, **kwargs):
        nonlocal eval_seconds
        started = time.perf_counter()
        try:
            metrics, samples = evaluate(config, policy_dir, data_dir, step, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            eval_seconds += seconds
        if curve is not None:
            curve.append({"step": step, "train_seconds": started - run_started - (eval_seconds - seconds), "val/acc": metrics["val/acc"]})
        return metrics, samples

    validation.evaluate = timed_evaluate
    try:
        policy, summary = dapo_loop(
            preset=preset, overrides_json=json.dumps({"model_path": str(work / "policy-0"), **overrides}),
            total_steps=steps, train_data=str(work / "data" / setup.TRAIN_FILE), val_data=str(work / "data" / setup.VAL_FILE),
            mlflow_tracking_uri=f"sqlite:///{work / 'mlflow.db'}", mlflow_experiment="benchmarks", model_name=name,
            steps_per_chunk=steps_per_chunk,
        )
    finally:
        validation.evaluate = evaluate
    return policy.path, run_history(summary.mlflow_tracking_uri, summary.mlflow_run_id), eval_seconds
