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
  rollout beside step t's update (dapo.execution.overlap), OMP_NUM_THREADS=1 (a core each).
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
(``dapo.execution.stages.validation.evaluate``: avg@4 on the 80 held-out problems), mean ± std over seeds.
Time to accuracy: every CURVE_EVERY steps each run's policy is validated by that function
too (ours inside dapo_loop, val_every; TRL's saved models afterwards), and the training
seconds to the first validation at or above TRL's final accuracy (mean over seeds) are
compared: the issue's "wall time to the same validation accuracy".

    make bench-trl                                   # installs the bench extra, then runs
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py [--steps 30] [--seeds 0,1,2] [--runs ours,ours-colocated,ours-overlapped,ours-nods,trl]

The real model (``--preset smollm2_cpu``: SmolLM2-135M-Instruct on reasoning-gym's chain_sum,
the preset's 12 steps of 8 prompts x 8, max response 96 tokens, lr 1e-5, one update a step),
``ours-colocated`` (the preset as ``make run-real`` runs it) against ``trl``, both from the GGUF
converted once (outside both clocks) and the same data files; each row scored by its
source's scorer (the task's own score_answer) on both sides. A seed an invocation, its
records appended to benchmarks/results/vs_trl_smollm2.jsonl, the table built from that file;
ours' records hold where a step's time goes (benchmarks/overhead.py's breakdown) and TRL's
its generation, scoring and update seconds:

    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --preset smollm2_cpu --seed 0 --runs trl   # ~15 min
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --preset smollm2_cpu --seed 0 --runs ours-colocated
    PYTHONPATH=. .venv/bin/python benchmarks/vs_trl.py --preset smollm2_cpu --table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common import REPO, child_env, chosen, peak_rss_mib, prepare_start, print_result, run_dapo_loop, run_worker
from benchmarks.overhead import ExclusiveTimer, instrument

RUNS = ("ours", "ours-colocated", "ours-overlapped", "ours-nods", "trl")


@dataclass(frozen=True)
class Setting:
    """A preset's side-by-side: its default steps, the steps between the accuracy curve's
    validations, the runs it allows, and where its per-seed records go (None: one
    invocation runs every seed and prints the table)."""

    preset: str
    steps: int
    curve_every: int
    runs: tuple[str, ...]
    results: Path | None = None
    omp_threads: int = 0
    """OMP_NUM_THREADS of its runs but one step off's (0: as the caller has it; in-process vLLM
    serves on 1 thread without it: dapo.engines.rollout.vllm_local.serving_threads)."""


SETTINGS = {
    # the curve every 10 steps: dapo_loop's chunk length, since a colocated chunk validates its last checkpoint only
    "tiny_cpu": Setting("tiny_cpu", steps=30, curve_every=10, runs=RUNS),
    # the preset's own 12 steps, validated every 4 (its chunk); one step off is left out: two
    # compute-bound processes on 2 cores slow each other
    "smollm2_cpu": Setting("smollm2_cpu", steps=12, curve_every=4, runs=("ours", "ours-colocated", "ours-nods", "trl"),
                           results=REPO / "benchmarks" / "results" / "vs_trl_smollm2.jsonl", omp_threads=2),
}


def base_config(setting: Setting, steps: int, seed: int = 0):
    """The preset with this benchmark's step count and seed, validated every curve_every steps."""
    from dapo.config import DAPOConfig

    return DAPOConfig.preset(setting.preset).replace(total_steps=steps, val_every=setting.curve_every, seed=seed)


def prepare(setting: Setting, work: Path) -> None:
    """Both sides' start under work/: data/ (train and validation parquet) and policy-0/
    (tiny_cpu: the warm-started embedded policy; smollm2_cpu: the GGUF converted once, so
    neither side's clock holds the conversion)."""
    if setting.preset == "tiny_cpu":
        prepare_start(work)
        return
    from dapo import checkpoint, resolve
    from dapo.execution.stages import setup

    if checkpoint.is_complete(work / "policy-0") and (work / "data" / setup.VAL_FILE).exists():
        print(f"reusing the data and starting policy in {work}", flush=True)
        return
    config = resolve.resolve_sources(base_config(setting, 1))
    print(f"preparing {config.train_data_path} and converting {config.model_path} ...", flush=True)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")


# --- ours -------------------------------------------------------------------------
def run_ours(setting: Setting, work: Path, steps: int, seed: int, name: str) -> dict:
    """dapo_loop, local flytekit execution, caching off; validation time is excluded."""
    execution = "colocated" if name in ("ours-colocated", "ours-overlapped") else "per_stage"
    overrides = {"val_every": setting.curve_every, "dynamic_sampling": name != "ours-nods", "seed": seed, "execution": execution}
    if name == "ours-overlapped":
        overrides.update(off_policy_steps=1, rollout_correction="token_tis")
    if setting.preset != "tiny_cpu":  # the data comes as parquet rows: their source's scorer, as resolve would set for the spec
        overrides["reward_fn_by_source"] = dict(setup_scorers(base_config(setting, steps)))
    timer = ExclusiveTimer()  # where a step's time goes: benchmarks/overhead.py's breakdown
    instrument(timer)
    started = time.perf_counter()
    curve: list[dict] = []
    model_dir, history, eval_seconds = run_dapo_loop(work, steps, overrides, f"vs-trl-{name}", curve=curve, preset=setting.preset)
    train_seconds = time.perf_counter() - started - eval_seconds
    profile = {f"{category}: {label}": seconds / steps for (category, label), seconds in timer.by_category("steps").items()}
    profile["Flyte: set-up tasks (config, data, policy, tracking, registration)"] = (timer.phase_total("setup+validation") - eval_seconds) / steps
    profile["untimed"] = train_seconds / steps - sum(profile.values())
    steps_run = [h for h in history if "policy_step/seconds" in h]
    mean = lambda key: statistics.fmean(h.get(key, 0.0) for h in steps_run)  # noqa: E731
    return {
        "curve": curve,
        "train_seconds": train_seconds,
        "eval_seconds_excluded": eval_seconds,
        "generated_tokens": sum(h.get("rollout/tokens", 0.0) for h in history),
        "trained_groups": sum(h.get("sampling/kept_groups", 0.0) for h in history),
        "step_parts": {"generation": mean("rollout/seconds"), "scoring": mean("reward/seconds"), "update": mean("policy_step/seconds"),
                       "of which log-prob pass": mean("actor/old_log_prob_seconds"), "of which weight sync": mean("sync/seconds")},
        "profile": dict(sorted(profile.items(), key=lambda item: -item[1])),
        "model_dir": model_dir,
    }


def setup_scorers(config) -> dict[str, str]:
    """reward_fn_by_source as resolve_config sets it for the preset's data spec."""
    from dapo import resolve

    return resolve.resolve_sources(config).reward_fn_by_source


# --- TRL --------------------------------------------------------------------------
class DapoReward:
    """Our rule-based reward as a TRL reward function (``reward_funcs=[DapoReward(...)]``).

    Each row is scored as our verify_rewards scores it: by its data_source's scorer
    (dapo.execution.stages.scoring.row_scorer) with its extra_info (TRL hands the data set's other
    columns to a reward function). TRL's global_step counts optimizer updates; our
    format-reward decay counts policy steps, which are updates_per_step updates each. Also
    counts the generated tokens and the seconds spent scoring.
    """

    __name__ = "dapo_reward"

    def __init__(self, config, updates_per_step: int):
        self.config = config
        self.updates_per_step = updates_per_step
        self.generated_tokens = 0
        self.seconds = 0.0

    def __call__(self, prompts, completions, completion_ids, ground_truth, trainer_state=None,
                 data_source=None, extra_info=None, **_) -> list[float]:
        from dapo.rewards import score_responses
        from dapo.config import RewardConfig, section_values
        from dapo.execution.stages.scoring import row_scorer, scoring_settings

        started = time.perf_counter()
        step = (trainer_state.global_step if trainer_state is not None else 0) // self.updates_per_step
        self.generated_tokens += sum(len(ids) for ids in completion_ids)
        texts = [completion[-1]["content"] if isinstance(completion, list) else completion for completion in completions]
        sources = data_source or [""] * len(texts)
        reward = section_values(self.config, RewardConfig)
        scores = score_responses(
            texts, list(ground_truth), [len(ids) for ids in completion_ids],
            scorers=[row_scorer(reward, source) for source in sources],
            extra_infos=[{**json.loads(extra or "{}"), "data_source": source} for extra, source in zip(extra_info or [None] * len(texts), sources)],
            **scoring_settings(reward, self.config.max_response_length, step),
        )
        self.seconds += time.perf_counter() - started
        return [float(score["reward"]) for score in scores]


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


def curve_saver(tokenizer, out_dir: Path, updates_per_step: int, curve_every: int, started: float):
    """A TRL callback that saves the policy every curve_every of our steps (validated after
    the run); its points' train_seconds leave the saving out."""
    from transformers import TrainerCallback

    class CurveSaver(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []
            self.saving = 0.0

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % (curve_every * updates_per_step) or state.global_step == args.max_steps:
                return  # the final model is saved and validated as every run's
            began = time.perf_counter()
            step = state.global_step // updates_per_step
            target = out_dir / f"step-{step}"
            model.save_pretrained(target)
            tokenizer.save_pretrained(target)
            self.points.append({"step": step, "train_seconds": began - started - self.saving, "model_dir": str(target)})
            self.saving += time.perf_counter() - began

    return CurveSaver()


def run_trl(setting: Setting, work: Path, steps: int, seed: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from dapo.data.prompts import load_prompts
    from dapo.execution.stages import setup

    config = base_config(setting, steps, seed)
    if setting.preset != "tiny_cpu":
        config = config.replace(reward_fn_by_source=setup_scorers(config))
    records, _ = load_prompts(work / "data" / setup.TRAIN_FILE)
    dataset = Dataset.from_list([{"prompt": r.chat, "ground_truth": r.ground_truth, "data_source": r.data_source,
                                  "extra_info": r.extra_info} for r in records])
    out_dir = work / f"trl-seed{seed}"
    reward = DapoReward(config, config.train_prompt_bsz // config.ppo_mini_batch_size)
    generation_seconds = 0.0

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, *args, **kwargs):  # TRL's rollout: transformers' generate, tokenizing included
            nonlocal generation_seconds
            began = time.perf_counter()
            try:
                return super()._generate(*args, **kwargs)
            finally:
                generation_seconds += time.perf_counter() - began

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work / "policy-0")
    tokenizer = AutoTokenizer.from_pretrained(work / "policy-0")
    saver = curve_saver(tokenizer, out_dir, reward.updates_per_step, setting.curve_every, started)
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(**trl_arguments(config, str(out_dir))),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[saver],
    )
    start_seconds = time.perf_counter() - started
    trainer.train()
    wall = time.perf_counter() - started - saver.saving
    trainer.save_model(str(out_dir / "final"))
    per_step = lambda seconds: seconds / steps  # noqa: E731
    return {
        "curve": saver.points,
        "train_seconds": wall,
        "eval_seconds_excluded": 0.0,
        "generated_tokens": float(reward.generated_tokens),
        "trained_groups": float(config.train_prompt_bsz * steps),
        "step_parts": {"generation": per_step(generation_seconds), "scoring": per_step(reward.seconds),
                       "update": per_step(wall - start_seconds - generation_seconds - reward.seconds)},
        "start_seconds": start_seconds,
        "model_dir": str(out_dir / "final"),
    }


# --- driver -----------------------------------------------------------------------
def worker(setting: Setting, name: str, work: Path, steps: int, seed: int) -> None:
    if name == "trl":
        result = run_trl(setting, work, steps, seed)
    else:
        result = run_ours(setting, work, steps, seed, name)
    result["peak_rss_mib"] = peak_rss_mib()
    print_result(result)


def launch(setting: Setting, name: str, work: Path, steps: int, seed: int) -> dict:
    command = [sys.executable, __file__, "--preset", setting.preset, "--worker", name, "--work", str(work),
               "--steps", str(steps), "--seeds", str(seed)]
    print(f"running {name}, seed {seed} ({steps} steps of {setting.preset}) ...", flush=True)
    started = time.perf_counter()
    env = child_env()
    if name == "ours-overlapped":
        env["OMP_NUM_THREADS"] = "1"  # its two processes at once: a core each
    elif setting.omp_threads:
        env["OMP_NUM_THREADS"] = str(setting.omp_threads)
    result = run_worker(command, name, env=env, log=work / f"{name}-seed{seed}.log")
    result.update(run=name, seed=seed)
    print(f"  {time.perf_counter() - started:.0f} s in all, {result['train_seconds'] / steps:.2f} s/step", flush=True)
    return result


def validate(setting: Setting, runs: list[dict], work: Path, steps: int) -> None:
    """Every curve point without a validation (TRL's saved models, a final model that the
    run did not validate) through the same validation function (validation.evaluate, the
    run's seed's validation sampling); each run's curve then runs from its start (step 0,
    0 s: the starting policy) to its final model."""
    from dapo.execution.stages import validation

    starts: dict[int, float] = {}
    for result in runs:
        config = base_config(setting, steps, result["seed"])
        curve = {p["step"]: p for p in result["curve"] if p["step"] <= steps}
        curve.setdefault(steps, {"step": steps, "model_dir": result["model_dir"]})
        curve[steps]["train_seconds"] = result["train_seconds"]
        if 0 not in curve:
            if result["seed"] not in starts:
                starts[result["seed"]] = validation.evaluate(config, str(work / "policy-0"), str(work / "data"), step=0)[0]["val/acc"]
            curve[0] = {"step": 0, "val/acc": starts[result["seed"]]}
        curve[0]["train_seconds"] = 0.0
        for point in curve.values():
            if "val/acc" not in point:
                metrics = validation.evaluate(config, point["model_dir"], str(work / "data"), step=point["step"])[0]
                point["val/acc"] = metrics["val/acc"]
        result["curve"] = [{key: p[key] for key in ("step", "train_seconds", "val/acc")} for _, p in sorted(curve.items())]


def final_accuracy(run: dict) -> float:
    """A run's validation accuracy on its final model: its curve's last point."""
    return run["curve"][-1]["val/acc"]


def seconds_to_accuracy(curve: list[dict], target: float) -> float | None:
    """Training seconds to the curve's first validation at or above target (None: never)."""
    return next((p["train_seconds"] for p in curve if p["val/acc"] >= target), None)


def summary(runs: list[dict], steps: int) -> dict:
    """Means over seeds (peak RSS: the largest), and the spread of the final and starting validation accuracy."""
    acc = [final_accuracy(r) for r in runs]
    gains = [final_accuracy(r) - r["curve"][0]["val/acc"] for r in runs]
    parts = {key: statistics.fmean(r["step_parts"][key] for r in runs) for key in runs[0].get("step_parts", {})}
    return {
        "seconds_per_step": statistics.fmean(r["train_seconds"] / steps for r in runs),
        "tokens_per_s": statistics.fmean(r["generated_tokens"] / r["train_seconds"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "val_acc": statistics.fmean(acc),
        "val_acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
        "gain": statistics.fmean(gains),
        "step_parts": parts,
    }


def report(setting: Setting, results: dict[str, list[dict]], steps: int) -> dict[str, dict]:
    config = base_config(setting, steps)
    seeds = sorted({r["seed"] for runs in results.values() for r in runs})
    print(f"\n{setting.preset}: {steps} steps of {config.train_prompt_bsz} prompts x {config.n_samples_per_prompt} responses "
          f"(ours with dynamic sampling: up to {config.max_num_gen_batches} rounds of {config.gen_prompt_bsz} prompts), "
          f"max response {config.max_response_length} tokens, {config.train_prompt_bsz // config.ppo_mini_batch_size} update(s) a step; "
          f"seeds {seeds}; {os.cpu_count()} CPUs")
    print(f"{'run':<15} {'s/step':>7} {'gen tok/s':>10} {'peak RSS MiB':>13} {'val acc (mean ± std)':>21} {'gain':>6}  step parts (s)")
    table = {name: summary(runs, steps) for name, runs in results.items()}
    for name, r in table.items():
        parts = ", ".join(f"{key} {value:.1f}" for key, value in r["step_parts"].items())
        print(f"{name:<15} {r['seconds_per_step']:>7.2f} {r['tokens_per_s']:>10.0f} {r['peak_rss_mib']:>13.0f} "
              f"{r['val_acc']:>13.3f} ± {r['val_acc_std']:.3f} {r['gain']:>+6.3f}  {parts}")
    for name, runs in results.items():
        print_profile(name, [r["profile"] for r in runs if r.get("profile")])
    if "trl" not in table:
        return table
    trl = table["trl"]
    for name in (n for n in table if n != "trl"):
        r = table[name]
        print(f"{name} / trl: wall per step x{r['seconds_per_step'] / trl['seconds_per_step']:.2f}, "
              f"tokens/s x{r['tokens_per_s'] / trl['tokens_per_s']:.2f}, peak RSS x{r['peak_rss_mib'] / trl['peak_rss_mib']:.2f}, "
              f"val acc {r['val_acc']:.3f} vs {trl['val_acc']:.3f}")
    target = trl["val_acc"]
    finals = [final_accuracy(r) for r in results["trl"]]
    spread = max(finals) - min(finals)
    valid = trl["gain"] > 2 * spread
    print(f"\ntime to TRL's final validation accuracy ({target:.3f}, mean of {len(finals)} seeds), validations every "
          f"{setting.curve_every} steps (the first at or above it; training seconds with each side's start, validation left out):")
    print(f"  TRL's gain over its start {trl['gain']:+.3f} against twice its seed spread {2 * spread:.3f}: the comparison is "
          + ("valid" if valid else "NOT valid: compare seconds per step and tokens/s at equal work (ours-nods vs trl) instead"))
    trl_mean = None
    for name, runs in sorted(results.items(), key=lambda item: item[0] != "trl"):
        times = [seconds_to_accuracy(r["curve"], target) for r in runs]
        reached = [t for t in times if t is not None]
        mean = statistics.fmean(reached) if reached else None
        curves = "; ".join(" ".join(f"{p['step']}:{p['val/acc']:.3f}@{p['train_seconds']:.0f}s" for p in r["curve"]) for r in runs)
        if name == "trl":
            trl_mean = mean
        ratio = f", TRL's time / this one's = {trl_mean / mean:.2f}" if mean and trl_mean and name != "trl" else ""
        print(f"  {name:<15} reached by {len(reached)}/{len(runs)} seeds"
              f"{f' in {mean:.0f} s (mean of those){ratio}' if mean is not None else ''}; curves (step:acc@s) {curves}")
        table[name].update(seconds_to_trl_accuracy=mean, seeds_reaching_trl_accuracy=len(reached), comparison_valid=valid)
    return table


def print_profile(name: str, profiles: list[dict[str, float]]) -> None:
    """A run's step, where its seconds go (benchmarks/overhead.py's exclusive times, chunk
    starts spread over the steps), mean over seeds; parts under 0.05 s a step left out."""
    if not profiles:
        return
    keys = {key for profile in profiles for key in profile}
    means = sorted(((statistics.fmean(p.get(key, 0.0) for p in profiles), key) for key in keys), reverse=True)
    print(f"{name}: a step's seconds by part (mean of {len(profiles)} seed(s), validation left out)")
    for seconds, key in (item for item in means if item[0] >= 0.05):
        print(f"  {seconds:7.2f}  {key}")


def recorded(path: Path) -> dict[str, list[dict]]:
    """The records of a results file by run, a (run, seed)'s newest record only."""
    if not path.exists():
        raise SystemExit(f"{path}: no seed recorded yet (run with --seed N)")
    newest = {(r["run"], r["seed"]): r for r in map(json.loads, filter(str.strip, path.read_text().splitlines()))}
    by_run: dict[str, list[dict]] = {}
    for (name, _), record in sorted(newest.items()):
        by_run.setdefault(name, []).append(record)
    return by_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny_cpu", choices=sorted(SETTINGS), help="the side-by-side's preset")
    parser.add_argument("--steps", type=int, default=0, help="steps of each run (0: the preset's: tiny_cpu 30, smollm2_cpu 12)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (the start is the same)")
    parser.add_argument("--seed", type=int, default=None, help="smollm2_cpu: run this seed only and append its records")
    parser.add_argument("--table", action="store_true", help="smollm2_cpu: print the table of the recorded seeds and stop")
    parser.add_argument("--runs", default="", help="comma-separated subset of the preset's runs (tiny_cpu: all of "
                        f"{RUNS}; smollm2_cpu: ours-colocated,trl)")
    parser.add_argument("--work", default="", help="working directory (a temporary one if empty; smollm2_cpu: reused between seeds if given)")
    parser.add_argument("--results", default="", help="smollm2_cpu: the records file (default benchmarks/results/vs_trl_smollm2.jsonl)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    setting = SETTINGS[args.preset]
    if args.results:
        setting = replace(setting, results=Path(args.results))
    steps = args.steps or setting.steps
    seeds = [args.seed] if args.seed is not None else [int(seed) for seed in args.seeds.split(",")]
    if args.worker:
        worker(setting, args.worker, Path(args.work), steps, seeds[0])
        return
    if args.table:
        if setting.results is None:
            raise SystemExit(f"--table: {setting.preset} keeps no records; run it")
        report(setting, recorded(setting.results), steps)
        return
    names = chosen(args.runs or ("ours-colocated,trl" if setting.results else ",".join(RUNS)), setting.runs, "run(s)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(setting, work)
        results = {name: [launch(setting, name, work, steps, seed) for seed in seeds] for name in names}
        validate(setting, [r for runs in results.values() for r in runs], work, steps)
    if setting.results is not None:
        setting.results.parent.mkdir(parents=True, exist_ok=True)
        with open(setting.results, "a") as out:
            for result in (r for runs in results.values() for r in runs):
                record = {key: value for key, value in result.items() if key != "model_dir"}
                out.write(json.dumps({**record, "preset": setting.preset, "steps": steps, "date": time.strftime("%Y-%m-%d"),
                                      "cpus": os.cpu_count()}) + "\n")
        results = recorded(setting.results)
    table = report(setting, results, steps)
    print(f"\nbenchmark wall time: {(time.perf_counter() - started) / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": table}, indent=2))


if __name__ == "__main__":
    main()
