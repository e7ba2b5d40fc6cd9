"""One generation round: rollout (GPU), reward verification and group filtering (CPU)."""

from __future__ import annotations

import pyarrow as pa
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory

from dapo.algorithm.sampling import SamplingState
from dapo.config import StepConfig
from dapo.execution.stages import generation, scoring
from images.specs import CPU_IMAGE, ROLLOUT_IMAGE
from tasks.common import ROLLOUT_POD, Checkpoint, cache, download_weights, task_entry
from tasks.flytekit_fixes import LiteralEcho, register_dataclass

register_dataclass(SamplingState)

RoundResult = tuple[pa.Table, SamplingState, bool]
"""(batch, sampling_state, done) after a round, as unnamed outputs (o0, o1, o2): both
branches of a round's conditional (sample_round, keep_round) return these."""


@task(
    cache=cache(__name__),
    container_image=ROLLOUT_IMAGE,
    **ROLLOUT_POD,
)
@task_entry
def rollout(
    config: StepConfig, policy: Checkpoint, data: FlyteDirectory, step: int, round_index: int, shard: int
) -> pa.Table:
    """G sampled responses per prompt of this round's slice `shard`, with the sampler's token
    log-probs; the shard's rollout metrics ride in the table's schema metadata (map tasks
    take one output)."""
    from tqdm import tqdm

    with tqdm(desc=f"rollout step {step} round {round_index} shard {shard}", unit="sample", leave=False) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        table, metrics = generation.rollout(
            config, download_weights(policy), data.download(), step, round_index, shard, progress=progress
        )
    return generation.with_rollout_metrics(table, metrics)


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="4", mem="8Gi"))
@task_entry
def verify_rewards(config: StepConfig, responses: pa.Table, step: int) -> pa.Table:
    """Rule-based rewards: correctness, soft overlong penalty, soft format reward."""
    return generation.timed_rewards(config, responses, step, generation.rollout_metrics_of(responses))


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"))
@task_entry
def filter_groups(
    config: StepConfig, scored: list[pa.Table], kept: pa.Table | None, sampling_state: SamplingState
) -> RoundResult:
    """Dynamic sampling over the round's shards: keep groups whose rewards differ; done when full or out of rounds."""
    round_table, rollout_metrics = generation.merge_shards(scored)
    batch, state = scoring.filter_groups(config, round_table, kept, sampling_state, rollout_metrics)
    return batch, state, state.done


keep_batch = LiteralEcho(name="keep_batch", inputs={"batch": pa.Table})
keep_sampling_state = LiteralEcho(name="keep_sampling_state", inputs={"sampling_state": SamplingState})
keep_done = LiteralEcho(name="keep_done", inputs={"done": bool})
"""Echo tasks run in FlytePropeller (its `echo` plugin, enabled in k8s/flyte-binary-values.yaml):
no pod, nothing downloaded or uploaded. The plugin echoes one input, hence one task per
value (workflows.dapo.keep_round); locally LiteralEcho passes the literal on as the plugin does."""
