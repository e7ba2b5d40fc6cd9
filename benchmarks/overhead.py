"""Where a local DAPO step's wall time goes: compute vs Flyte, checkpoints and MLflow.

Four runs of the same steps in one process, from the same starting policy and seeds
(so the same work):

1. ``plain``: the step as plain function calls (dapo.execution.stages: rollout, verify_rewards,
   filter_groups, policy_step), checkpoints on local disk, no Flyte and no MLflow.
2. ``per_stage``: ``dapo_loop`` executed locally by flytekit (caching off), as ``make run`` does.
3. ``colocated``: the same with ``execution="colocated"`` (one task for the steps,
   trainer and vLLM resident, weights synced in memory, a checkpoint recorded per step);
   ``coloc/10``: colocated recording a checkpoint once in 10 steps.

During both, every call of the functions below is timed; nested timed calls are
subtracted from their caller, so each second is counted once ("exclusive" time):

    compute       rollout generation (engine.generate), policy update (policy_update)
    algorithm     reward verification and group filtering
    checkpoints   trainer start (weights + optimizer state in, DeepSpeed init), weights
                  into the rollout engine (from a checkpoint or in memory), trainer
                  save/close, content hashing
    MLflow        tracking.deliver
    Flyte         inputs/outputs to and from literals (type engine, artifact copies),
                  task dispatch, decks, dynamic-workflow compilation, node orchestration
    task bodies   the rest of our task code (tokenizer and parquet loading, plots)

The per-step figures cover the step loop only: set-up tasks and validation are
booked apart. The overhead share is everything but compute and algorithm work.

    make bench-overhead
    PYTHONPATH=. .venv/bin/python benchmarks/overhead.py [--steps 10]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import prepare_start, run_dapo_loop

DAPO_LOOP_RUNS = {
    "per_stage": {"execution": "per_stage"},
    "colocated": {"execution": "colocated"},  # a checkpoint recorded after every step
    "coloc/10": {"execution": "colocated", "colocated_checkpoint_every": 10},  # one per 10-step chunk
}
SETUP_TASKS = {"resolve_config", "prepare_data", "bootstrap_policy", "start_tracking", "finish_tracking", "evaluate", "register_model"}
COMPUTE, ALGORITHM = "compute", "algorithm"


class ExclusiveTimer:
    """Wall time per (phase, category, label), nested timed calls subtracted from their callers."""

    def __init__(self):
        self.totals: dict[tuple[str, str, str], float] = collections.defaultdict(float)
        self._stack: list[list] = []  # [key, started, time of timed children]
        self.phase = "steps"

    @contextmanager
    def span(self, category: str, label: str, phase: str | None = None):
        previous_phase = self.phase
        self.phase = phase or previous_phase
        frame = [(self.phase, category, label), time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.totals[frame[0]] += elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed
            self.phase = previous_phase

    def wrap(self, owner, name: str, category: str, label: str, phase_of=None, per_task: bool = False) -> None:
        """Time every call of owner.name (a module function or a method); per_task: a
        flytekit task method, booked per task."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            full_label = f"{label}: {short_name(args[0])}" if per_task else label
            with self.span(category, full_label, phase_of(*args) if phase_of else None):
                return original(*args, **kwargs)

        setattr(owner, name, timed)

    def phase_total(self, phase: str) -> float:
        return sum(v for (p, _, _), v in self.totals.items() if p == phase)

    def by_category(self, phase: str) -> dict[tuple[str, str], float]:
        return {(c, l): v for (p, c, l), v in self.totals.items() if p == phase}


def short_name(task) -> str:
    """A task's function name; a map task's as "map rollout" (flytekit names it map_<fn>_<hash>-arraynode)."""
    name = task.name.rsplit(".", 1)[-1]
    mapped = re.fullmatch(r"map_(\w+?)_[0-9a-f]{16,}-arraynode", name)
    return f"map {mapped.group(1)}" if mapped else name


def instrument(timer: ExclusiveTimer) -> None:
    """Wrap the functions of the module docstring's table."""
    from flytekit.core import base_task, python_function_task, workflow

    import dapo.engines.trainer
    import dapo.engines.update
    from dapo import checkpoint, report, tracking
    from dapo.engines import rollout
    from dapo.execution.stages import scoring, training
    from dapo.engines.rollout.base import RolloutEngine

    timer.wrap(RolloutEngine, "generate", COMPUTE, "rollout generation")
    timer.wrap(dapo.engines.update, "policy_update", COMPUTE, "policy update (old log-probs, forward, backward, optimizer)")
    timer.wrap(scoring, "verify_rewards", ALGORITHM, "reward verification")
    timer.wrap(scoring, "filter_groups", ALGORITHM, "dynamic-sampling filter")
    timer.wrap(dapo.engines.trainer, "make_trainer", "checkpoints", "trainer start (weights, optimizer state, DeepSpeed init)")
    timer.wrap(dapo.engines.trainer.PolicyTrainer, "save", "checkpoints", "checkpoint save")
    timer.wrap(dapo.engines.trainer.PolicyTrainer, "close", "checkpoints", "trainer close")
    timer.wrap(training, "copy_checkpoint", "checkpoints", "checkpoint save")
    timer.wrap(rollout, "cached_rollout_engine", "checkpoints", "weights into the rollout engine")
    timer.wrap(RolloutEngine, "load_weights_from_tensors", "checkpoints", "weights into the rollout engine (in memory)")
    timer.wrap(checkpoint, "content_hash", "checkpoints", "checkpoint hashing (cache keys)")
    timer.wrap(checkpoint, "recorded_hash", "checkpoints", "checkpoint hashing (cache keys)")
    timer.wrap(tracking, "deliver", "MLflow", "MLflow logging")
    timer.wrap(report, "learning_curves_png", "Flyte", "decks: learning-curve plots")

    phase_of_task = lambda task, *_: "setup+validation" if short_name(task) in SETUP_TASKS else None  # noqa: E731
    timer.wrap(base_task.PythonTask, "local_execute", "Flyte", "task set-up and local dispatch", phase_of_task)
    timer.wrap(base_task, "translate_inputs_to_literals", "Flyte", "inputs to literals")
    timer.wrap(base_task.PythonTask, "_literal_map_to_python_input", "Flyte", "literals to inputs", per_task=True)
    timer.wrap(base_task.PythonTask, "dispatch_execute", "Flyte", "outputs to literals", per_task=True)
    timer.wrap(python_function_task.PythonFunctionTask, "_write_decks", "Flyte", "decks", per_task=True)
    timer.wrap(workflow.WorkflowBase, "local_execute", "Flyte", "workflow and conditional orchestration")

    execute = python_function_task.PythonFunctionTask.execute

    def timed_execute(task, **kwargs):
        dynamic = task.execution_mode == python_function_task.PythonFunctionTask.ExecutionBehavior.DYNAMIC
        label = ("Flyte", "dynamic workflows (compilation, local execution)") if dynamic else ("task bodies", "task code (other)")
        with timer.span(*label):
            return execute(task, **kwargs)

    python_function_task.PythonFunctionTask.execute = timed_execute


def plain_loop(work: Path, out_root: Path, steps: int) -> None:
    """The same steps as dapo_loop, as plain calls: no Flyte, no MLflow."""
    from dapo.config import DAPOConfig
    from dapo.execution.stages import generation, training

    config = DAPOConfig.tiny_cpu().replace(model_path=str(work / "policy-0"), total_steps=steps, val_every=0)
    policy, data = str(work / "policy-0"), str(work / "data")
    for step in range(steps):
        batch, state = generation.sample_batch(config, policy, data, step)
        next_policy = str(out_root / f"policy-{step + 1}")
        training.policy_step(config, policy, batch, state, step, next_policy)
        policy = next_policy


def report(runs: dict[str, tuple[dict, float]], steps: int) -> None:
    """The per-step breakdown of the runs ({name: (exclusive seconds by (category, label),
    wall of the step loop)}) and their overhead shares."""
    keys = set().union(*(totals for totals, _ in runs.values()))
    rank = lambda key: (["compute", "algorithm"].index(key[0]) if key[0] in ("compute", "algorithm") else 2, key)  # noqa: E731
    print(f"\nper step (mean of {steps}; exclusive seconds)")
    print(f"{'category':<12} {'what':<62} " + " ".join(f"{name:>9}" for name in runs))
    for key in sorted(keys, key=rank):
        if max(totals.get(key, 0.0) for totals, _ in runs.values()) / steps >= 0.0005:
            print(f"{key[0]:<12} {key[1]:<62} " + " ".join(f"{totals.get(key, 0.0) / steps:>9.3f}" for totals, _ in runs.values()))
    for name, (totals, wall) in runs.items():
        untimed = wall - sum(totals.values())
        work = sum(v for (category, _), v in totals.items() if category in (COMPUTE, ALGORITHM))
        compute = sum(v for (category, _), v in totals.items() if category == COMPUTE)
        print(f"{name}: {wall / steps:.3f} s/step ({untimed / steps:+.3f} s untimed); compute {compute / steps:.3f}, "
              f"compute + algorithm {work / steps:.3f}; overhead share {1 - work / wall:.1%} "
              f"(counting reward verification and filtering as overhead too: {1 - compute / wall:.1%})")
        by_category = collections.defaultdict(float)
        for (category, _), value in totals.items():
            by_category[category] += value
        print("  " + ", ".join(f"{category} {value / wall:.1%}" for category, value in sorted(by_category.items(), key=lambda kv: -kv[1])))
    plain_wall = runs["plain"][1]
    print(", ".join(f"{name} / plain wall per step: x{wall / plain_wall:.2f}" for name, (_, wall) in runs.items() if name != "plain"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work", default="", help="working directory (a temporary one if empty)")
    args = parser.parse_args()
    started = time.perf_counter()
    timer = ExclusiveTimer()
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_start(work)
        instrument(timer)
        print("warm-up step (engine start, DeepSpeed's first initialisation; not counted) ...", flush=True)
        plain_loop(work, work / "warmup", 1)
        timer.totals.clear()

        print(f"plain: {args.steps} steps ...", flush=True)
        run_started = time.perf_counter()
        plain_loop(work, work / "plain", args.steps)
        plain_wall = time.perf_counter() - run_started
        plain = timer.by_category("steps")
        timer.totals.clear()

        runs = {"plain": (plain, plain_wall)}
        for name, overrides in DAPO_LOOP_RUNS.items():
            print(f"{name}: {args.steps} steps of dapo_loop ...", flush=True)
            run_started = time.perf_counter()
            run_dapo_loop(work, args.steps, {"val_every": 0, **overrides}, f"overhead-{name}", args.steps)
            wall = time.perf_counter() - run_started
            setup = timer.phase_total("setup+validation")
            print(f"{name} run: {wall:.1f} s in all, of which {setup:.1f} s set-up tasks and validation (left out below)")
            runs[name] = (timer.by_category("steps"), wall - setup)
            timer.totals.clear()
    report(runs, args.steps)
    print(f"\nbenchmark wall time: {(time.perf_counter() - started) / 60:.1f} min; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
