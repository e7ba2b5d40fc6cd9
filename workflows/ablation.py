"""DAPO ablations (dapo.ablation.STUDIES) on the embedded tiny policy.

    pyflyte run workflows/ablation.py ablation --seeds '[0, 1]' --total_steps 8
    pyflyte run workflows/ablation.py ablation --study fidelity --seeds '[0, 1, 2]' --total_steps 150

Every variant x seed is a dapo_loop sub-workflow with the same starting policy, data,
steps and seeds (the starting policy and data are shared from the cache). The report
(table and plots) goes to benchmarks/results/<study>/ and to MLflow (experiment dapo-ablation).
"""

from __future__ import annotations

import json
import shutil
import typing
from pathlib import Path

from flytekit import FlyteContextManager, Resources, dynamic, task, workflow
from flytekit.types.directory import FlyteDirectory

from dapo import ablation as ablations
from dapo import tracking
from images.specs import CPU_IMAGE
from tasks.common import scratch_dir, task_entry
from tasks.tracking import RunSummary
from workflows.dapo import DYNAMIC_POD, dapo_loop

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@dynamic(**DYNAMIC_POD)
def ablation_runs(
    study: str, seeds: list[int], total_steps: int, base_overrides_json: str, mlflow_tracking_uri: str
) -> list[RunSummary]:
    """Launch every (variant, seed) run; returns their summaries in grid order."""
    chosen, base = ablations.study(study), json.loads(base_overrides_json)
    summaries = []
    for variant, seed in chosen.grid(seeds):
        overrides = {**chosen.variant_overrides(variant), **base, "seed": seed}
        _, summary = dapo_loop(
            preset="tiny_cpu",
            overrides_json=json.dumps(overrides, sort_keys=True),
            total_steps=total_steps,
            train_data="",
            val_data="",
            mlflow_tracking_uri=mlflow_tracking_uri,
            mlflow_experiment="dapo-ablation",
            model_name=f"ablation-{study}-v{variant}",
            steps_per_chunk=total_steps,
        )
        summaries.append(summary)
    return summaries


class AblationReport(typing.NamedTuple):
    """The study's markdown table, and the directory with it, its curves and histories (the
    outputs of the task and of the workflow)."""

    table: str
    report: FlyteDirectory


@task(container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
@task_entry
def ablation_report(study: str, runs: list[RunSummary], seeds: list[int], mlflow_tracking_uri: str) -> AblationReport:
    """The table (markdown), curves and histories: this task's output directory, logged to
    MLflow, and in a local run also copied to benchmarks/results/<study>/."""
    chosen = ablations.study(study)
    histories = [tracking.run_history(run.mlflow_tracking_uri, run.mlflow_run_id) for run in runs]
    rows = ablations.summarize(chosen, histories, seeds)
    table = ablations.markdown_table(rows)
    out = Path(scratch_dir("ablation-report"))
    ablations.plot_curves(chosen, histories, seeds, out / "ablation_curves.png")
    (out / "ablation_table.md").write_text(table + "\n")
    (out / "ablation_histories.json").write_text(json.dumps({"study": study, "seeds": seeds, "histories": histories}))
    print(table, flush=True)
    target = tracking.RunTarget(
        tracking.default_tracking_uri(mlflow_tracking_uri),
        "dapo-ablation",
        f"report-{study}-{seeds}",
        "ablation-report",
    )
    records = [
        tracking.table_record("ablation_table.json", rows),
        tracking.artifact_record(out / "ablation_curves.png"),
        tracking.artifact_record(out / "ablation_histories.json"),
    ]
    records += [
        tracking.metrics_record(
            0, {f"{r['key']}/val_acc_mean": r["val_acc_mean"], f"{r['key']}/val_acc_std": r["val_acc_std"]}
        )
        for r in rows
    ]
    undelivered = tracking.deliver(target, records)
    if undelivered:
        tracking.spill(undelivered, out / "undelivered-tracking.jsonl")
    if FlyteContextManager.current_context().execution_state.is_local_execution():
        shutil.copytree(out, RESULTS_DIR / study, dirs_exist_ok=True)
    return AblationReport(table, FlyteDirectory(str(out)))


@workflow
def ablation(
    study: str = "table1",
    seeds: list[int] = [0, 1],  # noqa: B006 (Flyte reads a workflow's defaults from its signature)
    total_steps: int = 8,
    mlflow_tracking_uri: str = "",
    base_overrides_json: str = '{"val_every": 2}',
) -> AblationReport:
    """study: a dapo.ablation.STUDIES name; base_overrides_json: DAPOConfig fields set in
    every run, over the study's regime."""
    runs = ablation_runs(
        study=study,
        seeds=seeds,
        total_steps=total_steps,
        base_overrides_json=base_overrides_json,
        mlflow_tracking_uri=mlflow_tracking_uri,
    )
    return ablation_report(study=study, runs=runs, seeds=seeds, mlflow_tracking_uri=mlflow_tracking_uri)
