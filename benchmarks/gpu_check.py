"""What benchmarks/gpu_check.sh runs once Python is ready: the CUDA path in parts, time-boxed,
each part's failure caught and recorded, OUT/gpu_check.json rewritten after every part (a
lease that ends early keeps what was measured). With --cpu the same parts run small on the
CPU, to check the script itself (what only a GPU has is reported as skipped there).

Parts, in order (--parts picks some; each says what it measures and its pass figure):
  versions   Python, torch, CUDA, transformers, triton, vLLM, DeepSpeed; a C compiler and
             Python's headers (Triton compiles its launcher with them).
  triton     a trivial Triton kernel (GPU only).
  engine     a random policy with Qwen2.5-1.5B's shapes (head_dim 128, GQA 12:2, tied; built
             on the GPU; on --cpu two layers of width 256 with head_dim 128): engine start
             seconds, the model runner and attention backend vLLM chose, steady tokens/s of
             vLLM against transformers' generate on the same prompts. Pass: vLLM >= 5x.
  sync       the in-memory sync of the same weights, by the model's own load_weights
             ("direct") and by vLLM's layerwise reload: seconds each, greedy outputs after
             each bitwise equal to a repeat control's. Pass: equal; direct <= 0.5 s at 1.5B.
  sleep      vLLM's sleep level 2 (weights and KV cache freed), then a sync: the memory it
             freed against the engine's reservation, greedy outputs bitwise equal after it,
             and the memory returned on close. Pass: >= 90% freed; equal. (CUDA only.)
  colocated  three steps of dapo.execution.colocated.run_colocated (vLLM and DeepSpeed resident, vLLM's
             memory released during each update) on a warm-started head_dim-128 policy: sync
             seconds and the bf16 gap after each real update. Pass: within the rollout guard.

Without vLLM (--no-vllm, chosen by itself when `import vllm` fails) the hf-rollout parts of
benchmarks/gpu_check_hf.py run instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARTS = ("versions", "triton", "engine", "sync", "sleep", "colocated")
PART_SECONDS = {"versions": 20, "triton": 30, "engine": 150, "sync": 40, "sleep": 40, "colocated": 150}
"""Each part's expected seconds on one H100-class GPU (engine starts capture CUDA graphs):
a part is skipped when the time box has less left."""

PASS = {"vllm_over_hf_generate": 5.0, "direct_sync_seconds_1p5b": 0.5, "sleep_freed_fraction": 0.9}


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Check:
    """The run's shared state: its report (written after every part), the time box, the
    policy and engine the engine/sync/sleep parts share."""

    def __init__(self, out: Path, on_gpu: bool, budget_seconds: float):
        self.out, self.on_gpu = out, on_gpu
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_seconds
        self.dtype = "bfloat16" if on_gpu else "float32"
        self.report: dict = {"parts": {}, "pass": {}, "mode": "gpu" if on_gpu else "cpu (script check)"}
        self.policy_dir: str | None = None
        self.engine = None
        self.prompts: list[str] = []

    def write(self) -> None:
        path = self.out / "gpu_check.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.report, indent=1, default=str))
        path.with_suffix(".tmp").replace(path)

    def run(self, name: str, part) -> None:
        left = self.deadline - time.monotonic()
        estimate = PART_SECONDS[name] * (1 if self.on_gpu else 0.5)
        if left < estimate:
            self.report["parts"][name] = {"status": "skipped", "why": f"time box: {left:.0f} s left, the part takes ~{estimate} s"}
        else:
            log(f"{name} ...")
            started = time.perf_counter()
            try:
                result = part(self)
                status = {"status": "skipped", "why": result} if isinstance(result, str) else {"status": "ok", **result}
            except Exception as error:  # noqa: BLE001 - recorded; the next part still runs
                status = {"status": "failed", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            status["seconds"] = round(time.perf_counter() - started, 2)
            self.report["parts"][name] = status
        log(f"{name}: " + json.dumps({k: v for k, v in self.report["parts"][name].items() if k != "traceback"}, default=str))
        self.write()

    def close_engine(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.close()
        self.engine = None


def imported_distributions() -> list[str]:
    """The distributions whose files this process imported modules from (what
    benchmarks/gpu_kit.py must find on the GPU machine or carry there)."""
    from importlib.metadata import distributions

    owner = {}
    for dist in distributions():
        for file in dist.files or ():
            if file.suffix in (".py", ".so"):
                owner[str(dist.locate_file(file))] = dist.metadata["Name"]
    return sorted({owner[module.__file__] for module in list(sys.modules.values())
                   if getattr(module, "__file__", None) in owner})


def greedy(engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from dapo.engines.rollout import SamplingSettings

    return [c.token_ids for c in engine.generate(prompts, SamplingSettings(n=1, max_tokens=max_tokens, temperature=0.0))]


# --- parts ------------------------------------------------------------------------------
def versions(check: Check) -> dict:
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "transformers": transformers.__version__, "device": torch.cuda.get_device_name(0) if check.on_gpu else "cpu"}
    for name in ("triton", "vllm", "deepspeed", "accelerate"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - reported: the parts that need it fail with it
            found[name] = f"not importable: {type(error).__name__}: {error}"
    found["c_compiler"] = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found["python_headers"] = str(headers) if headers.exists() else f"missing ({headers})"
    return found


def triton_kernel(check: Check) -> dict | str:
    if not check.on_gpu:
        return "Triton runs on a GPU"
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)

    x, y = torch.rand(4096, device="cuda"), torch.rand(4096, device="cuda")
    out = torch.empty_like(x)
    started = time.perf_counter()
    add[(4,)](x, y, out, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    return {"compile_and_run_seconds": time.perf_counter() - started, "correct": bool(torch.equal(out, x + y))}


def engine_part(check: Check) -> dict:
    import torch

    from benchmarks.rollout import make_prompts
    from dapo.model.policy_matrix import QWEN2_5_1_5B_SHAPES, PolicyLayout, build_policy
    from dapo.engines.rollout import EngineSettings, SamplingSettings, make_rollout_engine
    from dapo.engines.rollout.vllm_engine import free_accelerator_bytes

    layout = QWEN2_5_1_5B_SHAPES if check.on_gpu else PolicyLayout(tied=True, hidden_size=256, head_dim=128, num_key_value_heads=1)
    started = time.perf_counter()
    check.policy_dir = build_policy(check.work / "policy-1p5b-shapes", layout, device="cuda" if check.on_gpu else "cpu",
                                    dtype=check.dtype)
    result = {"layout": dataclasses.asdict(layout), "build_seconds": time.perf_counter() - started}
    prompts, n, max_tokens = (64, 8, 128) if check.on_gpu else (4, 2, 16)
    check.prompts = make_prompts(check.policy_dir, prompts, seed=0)
    options = {"gpu_memory_utilization": 0.3, "enable_sleep_mode": True} if check.on_gpu else {}
    engine_settings = EngineSettings(dtype=check.dtype, max_model_len=512, seed=0)
    before = free_accelerator_bytes()
    started = time.perf_counter()
    check.engine = make_rollout_engine("vllm", check.policy_dir, engine_settings, **options)
    result["start_seconds"] = time.perf_counter() - started
    result["reserved_bytes"] = before - free_accelerator_bytes()
    result.update(runner_and_backend(check.engine))
    settings = SamplingSettings(n=n, max_tokens=max_tokens, temperature=1.0, seed=1)
    check.engine.generate(check.prompts, settings)  # the first batch compiles
    result["vllm_tokens_per_s"] = tokens_per_second(check.engine, check.prompts, settings)
    with make_rollout_engine("hf", check.policy_dir, engine_settings) as hf:
        result["hf_generate_tokens_per_s"] = tokens_per_second(hf, check.prompts, settings)
    result["vllm_over_hf_generate"] = result["vllm_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    check.report["pass"]["vllm_over_hf_generate"] = result["vllm_over_hf_generate"] >= PASS["vllm_over_hf_generate"]
    if check.on_gpu:
        torch.cuda.empty_cache()
    return result


def tokens_per_second(engine, prompts, settings) -> float:
    started = time.perf_counter()
    tokens = sum(len(c.token_ids) for c in engine.generate(prompts, settings))
    return tokens / (time.perf_counter() - started)


def runner_and_backend(engine) -> dict:
    """The model runner and attention backend the engine's worker chose (by name)."""

    def inspect(worker) -> dict:
        runner = worker.model_runner
        found = {"model_runner": f"{type(runner).__module__}.{type(runner).__name__}"}
        for attribute in ("attn_groups", "attn_backends"):
            groups = getattr(runner, attribute, None)
            if groups:
                found["attention_backends"] = sorted({str(getattr(getattr(g, "backend", g), "__name__", g))
                                                      for group in groups for g in (group if isinstance(group, list) else [group])})
                break
        compilation = worker.vllm_config.compilation_config
        found["cuda_graph_mode"] = str(getattr(compilation, "cudagraph_mode", None))
        return found

    with engine._vllm_call() as llm:
        return llm.collective_rpc(inspect)[0]


def sync_part(check: Check) -> dict | str:
    from dapo.engines.rollout.base import iter_safetensors

    if check.engine is None:
        return "needs the engine part's engine"
    engine, prompts = check.engine, check.prompts[:8]
    max_tokens = 64 if check.on_gpu else 16
    control = greedy(engine, prompts, max_tokens)
    result = {"repeat_control_equal": greedy(engine, prompts, max_tokens) == control}
    methods = ("direct", "layerwise") if check.on_gpu else ("layerwise",)
    for method in methods:
        engine.in_memory_sync = method
        for _ in range(2):  # the second is the steady one
            engine.load_weights_from_tensors(iter_safetensors(check.policy_dir))
        result[f"{method}_sync_seconds"] = engine.last_reload_seconds
        result[f"{method}_outputs_equal"] = greedy(engine, prompts, max_tokens) == control
    engine.in_memory_sync = methods[0]
    check.report["pass"]["outputs_equal_after_sync"] = result["repeat_control_equal"] and all(result[f"{m}_outputs_equal"] for m in methods)
    if check.on_gpu:
        check.report["pass"]["direct_sync_seconds_1p5b"] = result["direct_sync_seconds"] <= PASS["direct_sync_seconds_1p5b"]
    return result


def sleep_part(check: Check) -> dict | str:
    from dapo.engines.rollout.base import iter_safetensors
    from dapo.engines.rollout.vllm_engine import free_accelerator_bytes

    if not check.on_gpu:
        return "vLLM's sleep mode is a CUDA feature"
    if check.engine is None:
        return "needs the engine part's engine"
    engine, prompts = check.engine, check.prompts[:8]
    control = greedy(engine, prompts, 64)
    reserved = check.report["parts"]["engine"]["reserved_bytes"]
    before = free_accelerator_bytes()
    engine.release_memory()
    result = {"freed_bytes": free_accelerator_bytes() - before, "reserved_bytes": reserved}
    result["freed_fraction"] = result["freed_bytes"] / max(1, reserved)
    started = time.perf_counter()
    engine.load_weights_from_tensors(iter_safetensors(check.policy_dir))
    result["wake_and_sync_seconds"] = time.perf_counter() - started
    result["outputs_equal_after_sleep"] = greedy(engine, prompts, 64) == control
    before = free_accelerator_bytes()
    check.close_engine()
    result["returned_on_close_bytes"] = free_accelerator_bytes() - before
    result["returned_fraction"] = result["returned_on_close_bytes"] / max(1, reserved)
    check.report["pass"]["sleep_freed_fraction"] = result["freed_fraction"] >= PASS["sleep_freed_fraction"]
    check.report["pass"]["outputs_equal_after_sleep"] = result["outputs_equal_after_sleep"]
    return result


def colocated_part(check: Check) -> dict:
    from benchmarks.gpu_check_hf import check_config
    from dapo.execution.colocated import run_colocated
    from dapo.model.policy_matrix import PolicyLayout, build_policy
    from dapo.engines.rollout import close_cached_rollout_engine
    from dapo.execution.stages import setup

    check.close_engine()
    work = check.work / "colocated"
    layout = PolicyLayout(tied=True, warm_start_steps=100, hidden_size=256 if check.on_gpu else 128, head_dim=128,
                          num_hidden_layers=4 if check.on_gpu else 2, num_key_value_heads=1)
    policy = build_policy(work / "policy", layout)
    config = check_config(policy, check.dtype).replace(execution="colocated", colocated_release_rollout_memory=check.on_gpu)
    setup.prepare_data(config, work / "data")
    setup.bootstrap_policy(config, config.embedded_task, work / "policy-0")
    keys = ("sync/seconds", "guard/rollout_logprob_gap", "guard/regenerated", "guard/stopped", "rollout/tokens_per_s",
            "policy_step/seconds", "step/skipped")
    try:
        steps = run_colocated(config, str(work / "policy-0"), str(work / "data"), 0, 3, work / "records").step_metrics
    finally:
        close_cached_rollout_engine()
    gaps = [m["guard/rollout_logprob_gap"] for m in steps]
    check.report["pass"]["gap_within_guard"] = len(steps) == 3 and max(gaps) <= config.rollout_gap_threshold
    return {"threshold": config.rollout_gap_threshold, "released_during_updates": check.on_gpu,
            "steps": [{k: m.get(k) for k in keys} for m in steps]}


PART_FUNCTIONS = {"versions": versions, "triton": triton_kernel, "engine": engine_part, "sync": sync_part, "sleep": sleep_part,
                  "colocated": colocated_part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check"))
    parser.add_argument("--cpu", action="store_true", help="run small on the CPU (fp32) to check the script")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget-seconds", type=float, default=480, help="the time box: parts that would not fit are skipped")
    parser.add_argument("--no-vllm", action="store_true",
                        help="skip the vLLM parts; run the hf-rollout parts (the default when vllm cannot be imported)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.cpu else "cuda")
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not on_gpu:
        sys.exit("no CUDA device visible (use --cpu to check the script on a CPU)")
    check = Check(Path(args.out), on_gpu, args.budget_seconds)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    check.run("versions", versions)
    if args.no_vllm or str(check.report["parts"]["versions"].get("vllm", "not importable")).startswith("not importable"):
        from benchmarks import gpu_check_hf

        log("vLLM parts SKIPPED: running the hf-rollout parts (benchmarks/gpu_check_hf.py)")
        check.report["vllm_parts_skipped"] = [p for p in parts if p != "versions"]
        size = dict(hidden_size=256, num_hidden_layers=4) if on_gpu else {}
        gpu_check_hf.run({"hf_colocated", "hf_step", "hf_gap"}, check.work, size, check.dtype, on_gpu, check.report)
        check.write()
        return
    try:
        for name in parts:
            if name != "versions":
                check.run(name, PART_FUNCTIONS[name])
    finally:
        check.close_engine()
        if on_gpu:
            check.report["peak_gpu_memory_gib_torch"] = torch.cuda.max_memory_reserved() / 2**30
        check.report["imported_distributions"] = imported_distributions()
        check.write()
    log("pass figures: " + json.dumps(check.report["pass"]))


if __name__ == "__main__":
    main()
