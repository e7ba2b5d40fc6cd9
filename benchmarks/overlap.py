"""One step off policy against on policy: the overlapped chunk (dapo.execution.overlap: a trainer process
and a rollout process) against the colocated chunk (dapo.execution.colocated: one process), on the
embedded default (tiny_cpu: vLLM's CPU engine, DeepSpeed), on this machine's cores.

    make bench-overlap     # = PYTHONPATH=. .venv/bin/python benchmarks/overlap.py

Each (mode, seed) runs --steps steps as one chunk in a worker process of its own, from the
same start (the embedded data and warm-started policy `make run` builds), then validates the
last checkpoint (avg@4 on the held-out problems). The colocated chunk runs with
OMP_NUM_THREADS=2 (vLLM and the trainer each use both cores, in turn); the overlapped one with
OMP_NUM_THREADS=1 in each of its two processes (a core each, at once). The overlapped chunk
uses token_tis rollout correction (its config needs one).

Printed per run: seconds per step in the steady state (the median time between consecutive
steps' ends, the first step's start-up left out), the mean rollout and update seconds of a
step (steps 1 on), the chunk's whole wall time, the share of
its steps the trainer spent waiting for a batch (the rollout is the slower side) and the
validation accuracy; then per mode their means and the speed-up per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_env, chosen, prepare_start, print_result, run_worker

ONE_STEP_OFF = {"off_policy_steps": 1, "rollout_correction": "token_tis"}
MODES = {"colocated": ({}, "2"), "overlapped": (ONE_STEP_OFF, "1")}
"""Mode -> (config overrides, OMP_NUM_THREADS of its processes)."""


def worker(work: Path, mode: str, seed: int, steps: int) -> None:
    from dapo.execution.colocated import run_colocated
    from dapo.config import DAPOConfig
    from dapo.execution.overlap import run_overlapped
    from dapo.execution.stages import validation

    config = DAPOConfig.tiny_cpu().replace(model_path=str(work / "policy-0"), execution="colocated", seed=seed, total_steps=steps,
                                           **MODES[mode][0])
    out = work / f"{mode}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a chunk's records would resume it
    ends: list[float] = []
    started = time.perf_counter()
    run = run_overlapped if config.off_policy_steps else run_colocated
    result = run(config, str(work / "policy-0"), str(work / "data"), 0, steps, out,
                 on_step=lambda step, metrics: ends.append(time.perf_counter()))
    wall = time.perf_counter() - started
    metrics, _ = validation.evaluate(config, result.checkpoint_dir, str(work / "data"), steps)
    print_result({
        "mode": mode, "seed": seed, "wall_seconds": wall, "first_step_seconds": ends[0] - started,
        "seconds_per_step": statistics.median(b - a for a, b in zip(ends, ends[1:])),
        "wait_share": sum(m.get("off_policy/wait_seconds", 0.0) for m in result.step_metrics[1:]) / (ends[-1] - ends[0]),
        "val_acc": metrics["val/acc"], "train_acc": statistics.fmean(m.get("train/acc", 0.0) for m in result.step_metrics),
        "update_seconds": statistics.fmean(m["policy_step/seconds"] for m in result.step_metrics[1:]),
        "rollout_seconds": statistics.fmean(m["rollout/seconds"] for m in result.step_metrics[1:]),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    parser.add_argument("--work", default="", help="working directory (a temporary one if empty)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.work), args.worker[0], int(args.worker[1]), args.steps)
        return
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_start(work)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode in chosen(args.modes, MODES, "modes"):
                threads = MODES[mode][1]
                print(f"seed {seed}: {mode} chunk, {args.steps} steps ...", flush=True)
                command = [sys.executable, __file__, "--worker", mode, str(seed), "--work", str(work), "--steps", str(args.steps)]
                result = run_worker(command, f"{mode} seed {seed}", env={**child_env(), "OMP_NUM_THREADS": threads},
                                    log=work / f"{mode}-seed{seed}.log")
                print(f"  {result['seconds_per_step']:.2f} s/step, val/acc {result['val_acc']:.3f}", flush=True)
                results.append(result)
    print(f"\n{args.steps} steps, tiny_cpu, {os.cpu_count()} CPUs")
    print(f"{'mode':>10} {'seed':>4} {'s/step':>7} {'rollout s':>9} {'update s':>8} {'chunk s':>8} {'1st step s':>10} "
          f"{'waiting':>8} {'val/acc':>8} {'train/acc':>9}")
    for r in results:
        print(f"{r['mode']:>10} {r['seed']:>4} {r['seconds_per_step']:>7.2f} {r['rollout_seconds']:>9.2f} {r['update_seconds']:>8.2f} "
              f"{r['wall_seconds']:>8.1f} {r['first_step_seconds']:>10.1f} {r['wait_share']:>8.0%} {r['val_acc']:>8.3f} {r['train_acc']:>9.3f}")
    by_mode = {mode: [r for r in results if r["mode"] == mode] for mode in MODES}
    speedups = {}
    for mode, runs in by_mode.items():
        if not runs:
            continue
        accs = [r["val_acc"] for r in runs]
        print(f"{mode}: {statistics.fmean(r['seconds_per_step'] for r in runs):.2f} s/step, "
              f"{statistics.fmean(r['wall_seconds'] for r in runs):.1f} s a chunk, val/acc {statistics.fmean(accs):.3f} "
              f"(seeds {min(accs):.3f}-{max(accs):.3f})")
        if mode != "colocated" and by_mode["colocated"]:
            pairs = list(zip(by_mode["colocated"], runs))
            speedups[mode] = {"per_step": [c["seconds_per_step"] / o["seconds_per_step"] for c, o in pairs],
                              "chunk": [c["wall_seconds"] / o["wall_seconds"] for c, o in pairs]}
            print("  against colocated, by seed: per step " + ", ".join(f"{x:.2f}x" for x in speedups[mode]["per_step"])
                  + "; whole chunk " + ", ".join(f"{x:.2f}x" for x in speedups[mode]["chunk"]))
    print(f"\nbenchmark wall time: {(time.perf_counter() - started) / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "speedups": speedups}, indent=2))


if __name__ == "__main__":
    main()
