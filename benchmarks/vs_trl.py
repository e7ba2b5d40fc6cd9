"""Our DAPO pipeline vs Hugging Face TRL's GRPOTrainer, side by side in one run.

Same starting policy (the embedded tiny Qwen2 after its warm start), same task and
data, same prompts per step (16), G (8), max response length (32), updates per step
(4 mini-batches of 4 prompts), learning rate, seed and number of steps; the same
reward function (ours: correctness, soft overlong punishment, decaying soft format
reward), passed to TRL as a reward function.

Runs, each in its own process (so peak memory is its own), caching off:

- ``ours``: ``dapo_loop`` executed locally by flytekit, exactly as ``make run`` does
  (vLLM rollout, DeepSpeed update, MLflow tracking, checkpoints between tasks), full
  DAPO: dynamic sampling draws up to 3 rounds of 32 prompts to fill 16 informative groups.
- ``ours-colocated``: ``ours`` with ``execution="colocated"``: each chunk of 10 steps in
  one task, trainer and vLLM resident, the new weights synced into vLLM in memory.
- ``ours-overlapped``: ``ours-colocated`` one step off policy (``off_policy_steps=1``,
  ``token_tis`` correction): each chunk a trainer process and a rollout process, step t+1's
  rollout beside step t's update (dapo.overlap), OMP_NUM_THREADS=1 (a core each).
- ``ours-nods``: the same without dynamic sampling: 16 prompts x 8 generated per step,
  the work TRL does per step.
- ``trl``: ``GRPOTrainer`` configured as close to DAPO as TRL allows: ``loss_type="dapo"``
  (token-level loss), ``epsilon=0.2``/``epsilon_high=0.28`` (clip-higher),
  ``mask_truncated_completions=True``, ``beta=0`` (no KL), group-std advantages, no
  dynamic sampling (TRL has none). Generation with ``transformers`` (TRL's default;
  its vLLM modes need a GPU server or CUDA colocation).

Each run goes once per seed (the RL seed; the start is the same). Per run: wall time
per step (training only: evaluation is excluded on both sides), generated tokens/s,
peak RSS of the process; then every final model is validated by the same function
(``dapo.validation.evaluate``: avg@4 on the 80 held-out problems), mean ± std over seeds.
Time to accuracy: every CURVE_EVERY steps each run's policy is validated by that function
too (ours inside dapo_loop, val_every; TRL's saved models afterwards), and the training
seconds to the first validation at or above TRL's final accuracy (mean over seeds) are
compared: the issue's "wall time to the same validation accuracy".

    make bench-trl                                   # installs the bench extra, then runs
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py [--steps 30] [--seeds 0,1,2] [--runs ours,ours-colocated,ours-overlapped,ours-nods,trl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_env, chosen, peak_rss_mib, prepare_start, print_result, run_dapo_loop, run_worker
RUNS = ("ours", "ours-colocated", "ours-overlapped", "ours-nods", "trl")
CURVE_EVERY = 10
"""Steps between the validations of the accuracy curve: dapo_loop's chunk length, since a
colocated chunk validates its last checkpoint only."""


def base_config(steps: int, seed: int = 0):
    """The tiny_cpu preset with this benchmark's step count and seed, validated every CURVE_EVERY steps."""
    from dapo.config import DAPOConfig

    return DAPOConfig.tiny_cpu().replace(total_steps=steps, val_every=CURVE_EVERY, seed=seed)


# --- ours -------------------------------------------------------------------------
def run_ours(work: Path, steps: int, seed: int, name: str) -> dict:
    """dapo_loop, local flytekit execution, caching off; validation time is excluded."""
    execution = "colocated" if name in ("ours-colocated", "ours-overlapped") else "per_stage"
    overrides = {"val_every": CURVE_EVERY, "dynamic_sampling": name != "ours-nods", "seed": seed, "execution": execution}
    if name == "ours-overlapped":
        overrides.update(off_policy_steps=1, rollout_correction="token_tis")
    started = time.perf_counter()
    curve: list[dict] = []
    model_dir, history, eval_seconds = run_dapo_loop(work, steps, overrides, f"vs-trl-{name}", curve=curve)
    return {
        "curve": curve,
        "train_seconds": time.perf_counter() - started - eval_seconds,
        "eval_seconds_excluded": eval_seconds,
        "generated_tokens": sum(h.get("rollout/tokens", 0.0) for h in history),
        "trained_groups": sum(h.get("sampling/kept_groups", 0.0) for h in history),
        "model_dir": model_dir,
    }


# --- TRL --------------------------------------------------------------------------
class DapoReward:
    """Our rule-based reward as a TRL reward function (``reward_funcs=[DapoReward(...)]``).

    TRL's global_step counts optimizer updates; our format-reward decay counts policy
    steps, which are updates_per_step updates each. Also counts the generated tokens.
    """

    __name__ = "dapo_reward"

    def __init__(self, config, updates_per_step: int):
        self.config = config
        self.updates_per_step = updates_per_step
        self.generated_tokens = 0

    def __call__(self, prompts, completions, completion_ids, ground_truth, trainer_state=None, **_) -> list[float]:
        from dapo.stages.scoring import scoring_settings
        from dapo.rewards import score_response

        step = (trainer_state.global_step if trainer_state is not None else 0) // self.updates_per_step
        settings = scoring_settings(self.config, step)
        self.generated_tokens += sum(len(ids) for ids in completion_ids)
        rewards = []
        for completion, truth, ids in zip(completions, ground_truth, completion_ids):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            rewards.append(float(score_response(text, truth, len(ids), **settings)["reward"]))
        return rewards


def trl_arguments(config, output_dir: str) -> dict:
    """GRPOConfig arguments mirroring our DAPOConfig (one TRL step = one of our mini-batch updates)."""
    updates_per_step = config.train_prompt_bsz // config.ppo_mini_batch_size
    return dict(
        output_dir=output_dir,
        max_steps=config.total_steps * updates_per_step,
        per_device_train_batch_size=config.ppo_mini_batch_size * config.n_samples_per_prompt,
        gradient_accumulation_steps=1,
        steps_per_generation=updates_per_step,
        num_generations=config.n_samples_per_prompt,
        num_iterations=config.ppo_epochs,
        max_completion_length=config.max_response_length,
        temperature=config.temperature,
        top_p=config.top_p,
        learning_rate=config.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=config.warmup_steps * updates_per_step,
        weight_decay=config.weight_decay,
        max_grad_norm=config.grad_clip,
        loss_type="dapo",
        epsilon=config.clip_low,
        epsilon_high=config.clip_high,
        mask_truncated_completions=True,
        beta=0.0,
        scale_rewards="group",
        disable_dropout=True,
        use_cpu=True,
        bf16=False,
        seed=config.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=updates_per_step,
        log_completions=False,
        dataloader_num_workers=0,
    )


def curve_saver(tokenizer, out_dir: Path, updates_per_step: int, started: float):
    """A TRL callback that saves the policy every CURVE_EVERY of our steps (validated after
    the run); its points' train_seconds leave the saving out."""
    from transformers import TrainerCallback

    class CurveSaver(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []
            self.saving = 0.0

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % (CURVE_EVERY * updates_per_step) or state.global_step == args.max_steps:
                return  # the final model is saved and validated as every run's
            began = time.perf_counter()
            step = state.global_step // updates_per_step
            target = out_dir / f"step-{step}"
            model.save_pretrained(target)
            tokenizer.save_pretrained(target)
            self.points.append({"step": step, "train_seconds": began - started - self.saving, "model_dir": str(target)})
            self.saving += time.perf_counter() - began

    return CurveSaver()


def run_trl(work: Path, steps: int, seed: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from dapo.stages import setup
    from dapo.data import load_prompts

    config = base_config(steps, seed)
    records, _ = load_prompts(work / "data" / setup.TRAIN_FILE)
    dataset = Dataset.from_list([{"prompt": r.chat, "ground_truth": r.ground_truth} for r in records])
    out_dir = work / f"trl-seed{seed}"
    reward = DapoReward(config, config.train_prompt_bsz // config.ppo_mini_batch_size)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work / "policy-0")
    tokenizer = AutoTokenizer.from_pretrained(work / "policy-0")
    saver = curve_saver(tokenizer, out_dir, reward.updates_per_step, started)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(**trl_arguments(config, str(out_dir))),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[saver],
    )
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    wall = time.perf_counter() - started - saver.saving
    return {
        "curve": saver.points,
        "train_seconds": wall,
        "eval_seconds_excluded": 0.0,
        "generated_tokens": float(reward.generated_tokens),
        "trained_groups": float(config.train_prompt_bsz * steps),
        "model_dir": str(out_dir / "final"),
    }


# --- driver -----------------------------------------------------------------------
def worker(name: str, work: Path, steps: int, seed: int) -> None:
    if name == "trl":
        result = run_trl(work, steps, seed)
    else:
        result = run_ours(work, steps, seed, name)
    result["peak_rss_mib"] = peak_rss_mib()
    print_result(result)


def launch(name: str, work: Path, steps: int, seed: int) -> dict:
    command = [sys.executable, __file__, "--worker", name, "--work", str(work), "--steps", str(steps), "--seeds", str(seed)]
    print(f"running {name}, seed {seed} ({steps} steps) ...", flush=True)
    started = time.perf_counter()
    one_core_each = {**child_env(), "OMP_NUM_THREADS": "1"} if name == "ours-overlapped" else None  # its two processes at once
    result = run_worker(command, name, env=one_core_each, log=work / f"{name}-seed{seed}.log")
    result["seed"] = seed
    print(f"  {time.perf_counter() - started:.0f} s in all, {result['train_seconds'] / steps:.2f} s/step", flush=True)
    return result


def validate(results: dict[str, list[dict]], work: Path, steps: int) -> dict:
    """Every final model, and every curve point without a validation (TRL's saved models),
    through the same validation function (the seed's validation sampling); each run's
    curve then runs from the start (0 s) to its final model. Returns the starting policy's figures."""
    from dapo.stages import validation

    start, _ = validation.evaluate(base_config(steps), str(work / "policy-0"), str(work / "data"), step=0)
    for runs in results.values():
        for result in runs:
            config = base_config(steps, result["seed"])
            metrics, _ = validation.evaluate(config, result["model_dir"], str(work / "data"), step=steps)
            result.update({"val/acc": metrics["val/acc"], "val/format_score": metrics["val/format_score"]})
            for point in result["curve"]:
                if "val/acc" not in point:
                    point["val/acc"] = validation.evaluate(config, point["model_dir"], str(work / "data"), step=point["step"])[0]["val/acc"]
            inner = [p for p in result["curve"] if 0 < p["step"] < steps]
            result["curve"] = ([{"step": 0, "train_seconds": 0.0, "val/acc": start["val/acc"]}] + inner
                               + [{"step": steps, "train_seconds": result["train_seconds"], "val/acc": result["val/acc"]}])
    return start


def seconds_to_accuracy(curve: list[dict], target: float) -> float | None:
    """Training seconds to the curve's first validation at or above target (None: never)."""
    return next((p["train_seconds"] for p in curve if p["val/acc"] >= target), None)


def summary(runs: list[dict], steps: int) -> dict:
    """Means over seeds (peak RSS: the largest), and the spread of the validation accuracy."""
    acc = [r["val/acc"] for r in runs]
    return {
        "seconds_per_step": statistics.fmean(r["train_seconds"] / steps for r in runs),
        "tokens_per_s": statistics.fmean(r["generated_tokens"] / r["train_seconds"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "val_acc": statistics.fmean(acc),
        "val_acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
        "format_score": statistics.fmean(r["val/format_score"] for r in runs),
    }


def report(results: dict[str, list[dict]], start: dict, steps: int) -> dict[str, dict]:
    seeds = len(next(iter(results.values())))
    print(f"\n{steps} steps of 16 prompts x 8 responses (ours with dynamic sampling: up to 3 rounds of 32 prompts), "
          f"max response 32 tokens, 4 updates per step, {seeds} seed(s); {os.cpu_count()} CPUs, load average now {os.getloadavg()[0]:.1f}")
    print(f"validation accuracy at the start: {start['val/acc']:.3f} (format score {start['val/format_score']:.2f})")
    print(f"{'run':<15} {'s/step':>7} {'gen tok/s':>10} {'peak RSS MiB':>13} {'val acc (mean ± std)':>21} {'format':>7}")
    table = {name: summary(runs, steps) for name, runs in results.items()}
    for name, r in table.items():
        print(f"{name:<15} {r['seconds_per_step']:>7.2f} {r['tokens_per_s']:>10.0f} {r['peak_rss_mib']:>13.0f} "
              f"{r['val_acc']:>13.3f} ± {r['val_acc_std']:.3f} {r['format_score']:>7.2f}")
    if "trl" in table:
        trl = table["trl"]
        for name in (n for n in table if n != "trl"):
            r = table[name]
            print(f"{name} / trl: wall per step x{r['seconds_per_step'] / trl['seconds_per_step']:.2f}, "
                  f"tokens/s x{r['tokens_per_s'] / trl['tokens_per_s']:.2f}, peak RSS x{r['peak_rss_mib'] / trl['peak_rss_mib']:.2f}, "
                  f"val acc {r['val_acc']:.3f} vs {trl['val_acc']:.3f}")
        target = trl["val_acc"]
        print(f"\ntime to TRL's final validation accuracy ({target:.3f}), validations every {CURVE_EVERY} steps "
              "(the first at or above it; training seconds, validation left out):")
        trl_mean = None
        for name, runs in sorted(results.items(), key=lambda item: item[0] != "trl"):
            times = [seconds_to_accuracy(r["curve"], target) for r in runs]
            reached = [t for t in times if t is not None]
            mean = statistics.fmean(reached) if reached else None
            curves = "; ".join(" ".join(f"{p['step']}:{p['val/acc']:.3f}" for p in r["curve"]) for r in runs)
            if name == "trl":
                trl_mean = mean
            ratio = f", TRL's time / this one's = {trl_mean / mean:.2f}" if mean and trl_mean and name != "trl" else ""
            print(f"  {name:<15} reached by {len(reached)}/{len(runs)} seeds"
                  f"{f' in {mean:.0f} s (mean of those){ratio}' if mean is not None else ''}; curves (step:acc) {curves}")
            table[name]["seconds_to_trl_accuracy"] = mean
            table[name]["seeds_reaching_trl_accuracy"] = len(reached)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (the start is the same)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS}")
    parser.add_argument("--work", default="", help="working directory (a temporary one if empty)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.worker:
        worker(args.worker, Path(args.work), args.steps, seeds[0])
        return
    names = chosen(args.runs, RUNS, "run(s)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare_start(work)
        results = {name: [launch(name, work, args.steps, seed) for seed in seeds] for name in names}
        start = validate(results, work, args.steps)
    table = report(results, start, args.steps)
    print(f"\nbenchmark wall time: {(time.perf_counter() - started) / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"start": start, "runs": results, "summary": table}, indent=2))


if __name__ == "__main__":
    main()
