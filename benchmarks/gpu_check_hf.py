"""gpu_check's parts without vLLM (`benchmarks/gpu_check.py --no-vllm`, chosen by itself when
`import vllm` fails): the rollout engine is transformers' generate (rollout_backend="hf"),
the trainer DeepSpeed, both in this process on one GPU (or the CPU with --cpu).

- hf_colocated: three steps of dapo.execution.colocated.run_colocated for the tied and the untied
  generated Qwen2 policy: per step its wall seconds, sync/seconds (the in-memory weight
  sync), guard/rollout_logprob_gap (rollout vs trainer right after that sync), rollout
  tokens/s, policy_step/seconds and peak GPU memory (torch's allocator and NVML/nvidia-smi,
  sampled every 0.1 s).
- hf_step: one per-stage DAPO step (generation.sample_batch + training.policy_step, its own
  DeepSpeed trainer) on the tied policy, then the next step's rollout after the HF engine
  reloaded the new checkpoint in place, with the guard's metrics.
- hf_gap: the trainer's (DeepSpeed) sampled-token log-prob gap against the HF engine right
  after an in-memory sync of the trainer's updated weights, and against a fresh HF engine
  started on the checkpoint the trainer saved (same prompts and seed).

Nothing here imports vllm, flytekit or mlflow.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import torch


def check_config(model_dir: str, dtype: str):
    """The checks' DAPO config: the embedded task, 8 prompts x 8 samples a step."""
    from dapo.config import DAPOConfig

    return DAPOConfig.tiny_cpu().replace(
        model_path=model_dir, dtype=dtype, train_prompt_bsz=8, gen_prompt_bsz=16, ppo_mini_batch_size=4,
        n_samples_per_prompt=8, filter_metric="reward", max_response_length=64, overlong_buffer_len=16, max_num_gen_batches=3,
    )


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


class GpuMemorySampler:
    """Used memory of GPU 0 (whole device, as nvidia-smi shows it), sampled in a thread:
    the peak since the last `take_peak`. NVML (nvidia-ml-py) if importable, else nvidia-smi."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.peak_mib = 0.0
        self.overall_peak_mib = 0.0
        self.source = "none"
        self._read = None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            self.source = "nvml"
        except Exception:  # noqa: BLE001 - no NVML: fall back on nvidia-smi
            def smi() -> float:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, check=True, timeout=10).stdout
                return float(out.strip().splitlines()[0])
            try:
                smi()
                self._read, self.source, self.interval = smi, "nvidia-smi", max(interval, 0.5)
            except Exception:  # noqa: BLE001
                self._read = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self._read is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                used = self._read()
                self.peak_mib = max(self.peak_mib, used)
                self.overall_peak_mib = max(self.overall_peak_mib, used)
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.interval)

    def take_peak(self) -> float | None:
        if self._read is None:
            return None
        peak, self.peak_mib = self.peak_mib, 0.0
        return peak

    def stop(self) -> None:
        self._stop.set()


def hf_config(model_dir: str, dtype: str):
    """check_config with transformers' generate as the rollout engine."""
    return check_config(model_dir, dtype).replace(rollout_backend="hf", trainer_backend="deepspeed")


PEAK_ALLOCATED_GIB = [0.0]
"""The largest torch.cuda.max_memory_allocated seen by _peak_torch (it resets the counter)."""


def _peak_torch(on_gpu: bool) -> float | None:
    if not on_gpu:
        return None
    value = torch.cuda.max_memory_allocated() / 2**30
    PEAK_ALLOCATED_GIB[0] = max(PEAK_ALLOCATED_GIB[0], value)
    torch.cuda.reset_peak_memory_stats()
    return value


STEP_KEYS = ("sync/seconds", "guard/rollout_logprob_gap", "guard/threshold", "guard/regenerated", "guard/stopped",
             "rollout/tokens", "rollout/seconds", "rollout/tokens_per_s", "sampling/rounds", "sampling/kept_groups",
             "policy_step/seconds", "actor/num_updates", "actor/step_seconds", "actor/pg_loss", "actor/grad_norm",
             "actor/entropy", "step/skipped", "train/reward_mean", "train/acc")


def fresh_start(work: Path, model_dir: str, dtype: str, on_gpu: bool, sampler: GpuMemorySampler):
    """A part's config, data and starting checkpoint under work, no engine left from the last
    part, the peaks reset."""
    from dapo.execution.stages import setup
    from dapo.engines.rollout import close_cached_rollout_engine

    config = hf_config(model_dir, dtype)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")
    close_cached_rollout_engine()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sampler.take_peak()
    return config


def colocated_hf(work: Path, model_dir: str, dtype: str, on_gpu: bool, sampler: GpuMemorySampler, n_steps: int = 3,
                 overrides: dict | None = None, checkpoint_every: int = 1) -> dict:
    import dapo.engines.trainer
    from dapo.execution.colocated import run_colocated
    from dapo.execution.stages import generation
    from dapo.engines.rollout import close_cached_rollout_engine

    config = fresh_start(work, model_dir, dtype, on_gpu, sampler).replace(**(overrides or {}))
    setup: dict[str, float] = {}
    started = time.perf_counter()
    generation.policy_engine(config, str(work / "policy-0"))  # run_colocated gets this cached engine back
    setup["engine_start_seconds"] = time.perf_counter() - started

    original = dapo.engines.trainer.make_trainer

    def timed_make_trainer(*args, **kwargs):  # run_colocated looks it up in dapo.engines.trainer at call time
        began = time.perf_counter()
        trainer = original(*args, **kwargs)
        setup["trainer_start_seconds"] = time.perf_counter() - began
        return trainer

    steps: list[dict] = []
    marks = [time.perf_counter()]

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if on_gpu:
            torch.cuda.synchronize()
        now = time.perf_counter()
        row = {"step": step, "wall_seconds": now - marks[-1]}
        row.update({k: metrics.get(k) for k in STEP_KEYS if k in metrics})
        row["peak_gpu_allocated_gib_torch"] = _peak_torch(on_gpu)
        peak = sampler.take_peak() if on_gpu else None
        row["peak_gpu_used_mib_nvml"] = peak
        steps.append(row)
        log(f"  step {step}: " + json.dumps(row, default=str))
        marks.append(time.perf_counter())

    dapo.engines.trainer.make_trainer = timed_make_trainer
    try:
        result = run_colocated(config, str(work / "policy-0"), str(work / "data"), 0, n_steps, work / "records", on_step=on_step,
                               checkpoint_every=checkpoint_every)
    finally:
        dapo.engines.trainer.make_trainer = original
    total = time.perf_counter() - started
    close_cached_rollout_engine()
    return {
        "dtype": dtype, "rollout_backend": "hf", "trainer_backend": "deepspeed", "zero_stage": config.zero_stage,
        "threshold": config.rollout_gap_threshold, **setup,
        "note": "step 0's wall_seconds includes the DeepSpeed trainer's start (trainer_start_seconds); the HF engine was started before it",
        "steps": steps, "seconds_total": total, "checkpoint": result.checkpoint_dir,
    }


SCALE_LAYOUT = {"hidden_size": 2048, "num_hidden_layers": 36}
"""hf_scale's policy: a Qwen2 of ~1.4B parameters (a small policy's size; generated, random)."""


def scale_hf(work: Path, dtype: str, on_gpu: bool, sampler: GpuMemorySampler) -> dict:
    """The cluster cost model's per-node inputs (benchmarks/cluster_cost.py) measured at a
    real small policy's size on this GPU: two colocated steps (HF generate + DeepSpeed
    ZeRO-2 resident; no dynamic sampling, so that both update) with the trainer's start,
    the in-memory sync, and one checkpoint save (its bytes and rate, to this machine's disk)."""
    from safetensors import safe_open

    from dapo.model.policy_matrix import PolicyLayout, build_policy
    from dapo.engines.rollout.base import safetensors_files
    from dapo.engines.trainer.base import PolicyTrainer

    layout = SCALE_LAYOUT if on_gpu else {}  # --cpu checks the script on the small default layout
    began = time.perf_counter()
    model_dir = build_policy(work / "policy", PolicyLayout(tied=True, **layout))
    built = time.perf_counter() - began
    parameters = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), "pt") as weights:
            parameters += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    saves: list[dict] = []
    save = PolicyTrainer.save

    def timed_save(self, out_dir, step=None):
        started = time.perf_counter()
        save(self, out_dir, step)
        seconds = time.perf_counter() - started
        size = sum(p.stat().st_size for p in Path(out_dir).rglob("*") if p.is_file())
        saves.append({"seconds": seconds, "bytes": size, "bytes_per_s": size / seconds})

    PolicyTrainer.save = timed_save
    try:
        # The rollout guard off: a random policy this wide has logits so sharp that bf16
        # generate and the trainer's forward differ by ~0.26 nats a token (measured: the guard
        # refused it, also on a fresh engine); the gap is still measured and reported.
        run = colocated_hf(work / "run", model_dir, dtype, on_gpu, sampler, n_steps=2, checkpoint_every=2,
                           overrides={"dynamic_sampling": False, "max_rollout_logprob_gap": float("inf")})
    finally:
        PolicyTrainer.save = save
    return {"parameters": parameters, "layout": layout or "the default", "build_seconds": built, "saves": saves, **run}


def one_step_hf(work: Path, model_dir: str, dtype: str, on_gpu: bool, sampler: GpuMemorySampler) -> dict:
    from dapo.execution.stages import generation, guard, scoring, training
    from dapo.algorithm.sampling import SamplingState
    from dapo.engines.rollout import close_cached_rollout_engine

    config = fresh_start(work, model_dir, dtype, on_gpu, sampler)
    keys = ("guard/rollout_logprob_gap", "guard/threshold", "guard/regenerated", "guard/stopped", "actor/num_updates", "step/skipped",
            "sampling/kept_groups", "sampling/rounds", "rollout/tokens_per_s", "rollout/seconds", "actor/step_seconds", "actor/pg_loss",
            "train/reward_mean")
    started = time.perf_counter()
    kept, state = generation.sample_batch(config, str(work / "policy-0"), str(work / "data"), 0)
    sampled = time.perf_counter()
    metrics = training.policy_step(config, str(work / "policy-0"), kept, state, 0, work / "policy-1")
    stepped = time.perf_counter()
    guard.check_rollout_guard(config, metrics, 0)
    # the next step's rollout after the HF engine reloaded policy-1 from its files in place
    table, _ = generation.rollout(config, str(work / "policy-1"), str(work / "data"), 1, 0)
    engine = generation.policy_engine(config, str(work / "policy-1"))
    scored = scoring.verify_rewards(config, table, 1)
    state = SamplingState(rounds=1, generated_groups=1, kept_groups=1)
    after = training.policy_step(config, str(work / "policy-1"), scored, state, 1, work / "policy-2", regenerate=None)
    report = {
        "dtype": dtype, "rollout_backend": "hf", "trainer_backend": "deepspeed",
        "step0": {k: metrics.get(k) for k in keys},
        "step0_sample_batch_seconds": sampled - started,
        "step0_policy_step_seconds": stepped - sampled,
        "step1_after_in_place_reload": {k: after.get(k) for k in keys},
        "reload_mode": getattr(engine, "last_reload_mode", None),
        "seconds": time.perf_counter() - started,
        "peak_gpu_allocated_gib_torch": _peak_torch(on_gpu),
        "peak_gpu_used_mib_nvml": sampler.take_peak() if on_gpu else None,
    }
    close_cached_rollout_engine()
    return report


def sync_vs_fresh_gap(work: Path, model_dir: str, dtype: str) -> dict:
    """The trainer's log-prob gap to the HF engine: before any update (both on the same files),
    right after one real DAPO update synced in memory, and on a fresh engine on the saved checkpoint."""
    from dapo.execution.stages import generation, setup, training
    from dapo.data import prompts as data
    from dapo.algorithm.batch import collate_table
    from dapo.engines.rollout import EngineSettings, SamplingSettings, close_cached_rollout_engine, make_rollout_engine
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import _rollout_diff

    config = hf_config(model_dir, dtype)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")
    close_cached_rollout_engine()
    settings = EngineSettings.from_config(config)
    records, _ = data.load_prompts(work / "data" / setup.TRAIN_FILE)
    chosen = records[:8]
    sampling = SamplingSettings(n=8, max_tokens=config.max_response_length, temperature=config.temperature, top_p=config.top_p, seed=7)

    def gap(engine, trainer) -> tuple[float, float, int]:
        texts = [data.render_prompt(r, engine.tokenizer) for r in chosen]
        table = generation.completion_table(engine.generate(texts, sampling), chosen, texts, group_prefix="gap")
        batch = collate_table(table, trainer.pad_token_id)
        log_probs, _ = trainer.log_probs(batch, config.temperature)
        rollout = table.column("rollout_log_probs").to_pylist()
        per_token = torch.cat([(log_probs[i, : len(v)] - torch.tensor(v)).abs() for i, v in enumerate(rollout) if v])
        return _rollout_diff(table, log_probs, batch.response_mask), per_token.max().item(), per_token.numel()

    row: dict = {"dtype": dtype, "layout": "tied"}
    engine = make_rollout_engine("hf", str(work / "policy-0"), settings)
    trainer = make_trainer(config, str(work / "policy-0"))
    try:
        row["before_update_mean"], row["before_update_max"], row["tokens"] = gap(engine, trainer)
        batch, state = generation.sample_batch(config, str(work / "policy-0"), str(work / "data"), 0, engine=engine)
        metrics = training.step_metrics(config, batch, state)
        row["updated"] = training.train_on_batch(trainer, config, batch, 0, metrics, None)
        row["update_guard_gap"] = metrics.get("guard/rollout_logprob_gap")
        started = time.perf_counter()
        engine.load_weights_from_tensors(trainer.named_weights())
        row["sync_seconds"] = time.perf_counter() - started
        row["after_sync_mean"], row["after_sync_max"], _ = gap(engine, trainer)
        engine.close()
        trainer.save(str(work / "policy-1"), step=0)
        fresh = make_rollout_engine("hf", str(work / "policy-1"), settings)
        try:
            row["fresh_on_checkpoint_mean"], row["fresh_on_checkpoint_max"], _ = gap(fresh, trainer)
        finally:
            fresh.close()
    finally:
        trainer.close()
        if not engine.closed:
            engine.close()
    return row


def run(parts: set[str], work: Path, size: dict, dtype: str, on_gpu: bool, report: dict) -> None:
    """The no-vLLM parts into report (each part's failure recorded, the others still run)."""
    import traceback

    from dapo.model.policy_matrix import PolicyLayout, build_policy

    sampler = GpuMemorySampler() if on_gpu else None
    report["gpu_memory_sampler"] = sampler.source if sampler else None
    policies: dict[bool, str] = {}

    def policy(tied: bool) -> str:
        if tied not in policies:
            began = time.perf_counter()
            policies[tied] = build_policy(work / f"policy-{'tied' if tied else 'untied'}", PolicyLayout(tied=tied, warm_start_steps=100, **size))
            log(f"built the {'tied' if tied else 'untied'} policy ({size or 'CPU size'}) in {time.perf_counter() - began:.1f} s")
        return policies[tied]

    def attempt(name: str, fn) -> None:
        try:
            report[name] = fn()
            log(f"{name}: " + json.dumps(report[name], default=str))
        except Exception as error:  # noqa: BLE001 - record it, go on with the next part
            report.setdefault("failed", {})[name] = f"{type(error).__name__}: {error}"
            log(f"{name} FAILED:\n{traceback.format_exc()}")

    try:
        if "hf_colocated" in parts:
            for tied in (True, False):
                name = f"hf_colocated_{'tied' if tied else 'untied'}"
                log(f"{name}: three colocated steps (HF generate + DeepSpeed resident, weights synced in memory)")
                attempt(name, lambda tied=tied, name=name: colocated_hf(work / name, policy(tied), dtype, on_gpu, sampler or _NoSampler()))
        if "hf_step" in parts:
            log("hf_step: one per-stage DAPO step (HF generate + DeepSpeed) on the tied policy")
            attempt("hf_step", lambda: one_step_hf(work / "hf_step", policy(True), dtype, on_gpu, sampler or _NoSampler()))
        if "hf_scale" in parts:
            log(f"hf_scale: two colocated steps of a ~1.4B policy ({SCALE_LAYOUT}), the trainer start, sync and checkpoint save")
            attempt("hf_scale", lambda: scale_hf(work / "hf_scale", dtype, on_gpu, sampler or _NoSampler()))
        if "hf_gap" in parts:
            log("hf_gap: trainer vs HF engine after an in-memory sync and on a fresh engine")
            attempt("hf_gap", lambda: sync_vs_fresh_gap(work / "hf_gap", policy(True), dtype))
    finally:
        if on_gpu:
            report["peak_gpu_allocated_gib_torch_overall"] = max(PEAK_ALLOCATED_GIB[0], _peak_torch(on_gpu))
        if sampler:
            report["peak_gpu_used_mib_nvml_overall"] = sampler.overall_peak_mib
            sampler.stop()


class _NoSampler:
    def take_peak(self) -> None:
        return None
