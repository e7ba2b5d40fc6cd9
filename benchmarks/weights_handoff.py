"""The per-step cost of handing the policy from the trainer to the rollout engines.

Every step, policy_step writes a checkpoint (weights + trainer_state/, the optimizer
state) and every rollout pod loads the new weights. For Qwen2 models of growing
size (random weights, the embedded tokenizer, fp32 on this CPU), measured here:

- bytes: the weights vs the whole checkpoint (trainer_state/ holds DeepSpeed's own
  copy of the weights, its fp32 master weights and Adam's two moments);
- checkpoint save (DeepSpeed ZeRO-2 engine, after one real update so Adam's state exists);
- the artifact copy a rollout pod makes, whole checkpoint vs weights only
  (a local copy here; on a cluster a download from the object store);
- loading the new weights into a live vLLM engine in place vs starting an engine.

Then the bytes a rollout pod moves per step for 7B and 32B policies at
--bandwidth-gbps, which is an assumption to set for your cluster, not a measurement:
bf16 weights are 2 bytes/param; the whole checkpoint as DeepSpeed writes it is 16
(the weights twice, then fp32 master weights and two fp32 Adam moments: the 5x
measured here in fp32 is 4 + 4 + 12 bytes). tasks.common.download_weights, which
rollout and validation use, moves the weights only.

    PYTHONPATH=. .venv/bin/python benchmarks/weights_handoff.py [--sizes tiny,25m,150m]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import chosen
from benchmarks.train_step import scored_batch
from dapo.engines.trainer import STATE_DIR

SIZES = {  # name: (hidden, layers, intermediate, heads)
    "tiny": (128, 4, 384, 4),
    "25m": (512, 8, 1536, 4),
    "150m": (1024, 12, 3072, 8),
    "450m": (1536, 16, 4608, 12),
}


def tree_bytes(path: Path, only_state: bool | None = None) -> int:
    """Bytes of the files under path: all, only trainer_state/ (True) or all but it (False)."""
    total = 0
    for file in path.rglob("*"):
        if not file.is_file():
            continue
        in_state = STATE_DIR in file.relative_to(path).parts
        if only_state is None or in_state == only_state:
            total += file.stat().st_size
    return total


def timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def measure(name: str, work: Path) -> dict:
    from dapo.config import DAPOConfig
    from dapo.model.policy import TinyPolicySpec, build_tiny_policy
    from dapo.engines.rollout import EngineSettings, make_rollout_engine
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import policy_update

    hidden, layers, intermediate, heads = SIZES[name]
    source = work / f"{name}-source"
    spec = TinyPolicySpec(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                          num_attention_heads=heads, num_key_value_heads=2, warm_start_steps=1)
    build_tiny_policy(source, spec)
    config = DAPOConfig.tiny_cpu().replace(dtype="float32", trainer_backend="deepspeed", zero_stage=2)
    trainer = make_trainer(config, source)
    params = sum(p.numel() for p in trainer.module.parameters())
    policy_update(trainer, scored_batch(4, 8), config.replace(train_prompt_bsz=4, gen_prompt_bsz=4), step=0, temperature=1.0)
    full = work / f"{name}-step1"
    save_s = timed(trainer.save, full, step=1)
    trainer.close()

    copy_full_s = timed(shutil.copytree, full, work / f"{name}-pod-full")
    weights_only = work / f"{name}-pod-weights"
    copy_weights_s = timed(shutil.copytree, full, weights_only, ignore=shutil.ignore_patterns(STATE_DIR))

    started = time.perf_counter()
    engine = make_rollout_engine("vllm", source, EngineSettings(dtype="float32", max_model_len=256, seed=0))
    start_s = time.perf_counter() - started
    reload_s = timed(engine.load_weights, weights_only)
    engine.close()
    return {
        "size": name, "params": params,
        "weights_mb": tree_bytes(full, only_state=False) / 1e6, "state_mb": tree_bytes(full, only_state=True) / 1e6,
        "save_s": save_s, "copy_full_s": copy_full_s, "copy_weights_s": copy_weights_s,
        "engine_start_s": start_s, "engine_reload_s": reload_s,
    }


def report(rows: list[dict], bandwidth_gbps: float) -> None:
    print(f"\n{'size':<6} {'params':>11} {'weights MB':>11} {'ckpt MB':>9} {'ckpt/weights':>13} {'save s':>7} "
          f"{'copy ckpt s':>12} {'copy weights s':>15} {'vLLM reload s':>14} {'vLLM start s':>13}")
    for r in rows:
        whole = r["weights_mb"] + r["state_mb"]
        print(f"{r['size']:<6} {r['params']:>11,} {r['weights_mb']:>11.1f} {whole:>9.1f} {whole / r['weights_mb']:>12.2f}x "
              f"{r['save_s']:>7.2f} {r['copy_full_s']:>12.3f} {r['copy_weights_s']:>15.3f} {r['engine_reload_s']:>14.3f} {r['engine_start_s']:>13.2f}")
    largest = max(rows, key=lambda r: r["params"])
    print(f"\nlargest here ({largest['size']}): copying the weights only takes x{largest['copy_weights_s'] / largest['copy_full_s']:.2f} "
          f"of the whole checkpoint's time; an in-place vLLM reload takes x{largest['engine_reload_s'] / largest['engine_start_s']:.2f} of an engine start")
    bytes_per_s = bandwidth_gbps * 1e9 / 8
    print(f"\nper rollout pod and step at {bandwidth_gbps:g} Gbit/s (bf16 weights 2 B/param; the whole DeepSpeed "
          "checkpoint 16 B/param):")
    for billions in (7, 32):
        weights, whole = billions * 1e9 * 2, billions * 1e9 * 16
        print(f"  {billions}B: weights {weights / 1e9:.0f} GB -> {weights / bytes_per_s:.0f} s; "
              f"whole checkpoint {whole / 1e9:.0f} GB -> {whole / bytes_per_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,25m,150m", help=f"comma-separated subset of {list(SIZES)}")
    parser.add_argument("--bandwidth-gbps", type=float, default=25.0, help="object store -> pod bandwidth assumed for the estimate")
    args = parser.parse_args()
    names = chosen(args.sizes, SIZES, "size(s)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="handoff-") as tmp:
        rows = []
        for name in names:
            print(f"measuring {name} ...", flush=True)
            rows.append(measure(name, Path(tmp)))
    report(rows, args.bandwidth_gbps)
    print(f"\nbenchmark wall time: {(time.perf_counter() - started) / 60:.1f} min; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
