"""The run budget: whether each cluster task's timeout covers its work, checked before any work.

Flyte gives a task node two limits (flytepropeller, pkg/compiler/transformers/k8s/node.go):
its timeout bounds each attempt (the node's execution deadline), and twice its timeout
bounds the node from when it was first queued, every retry included (its active deadline).
So a timeout must cover one attempt's work, and twice it the first attempt and every
retry, each retry starting where its task restarts: a colocated chunk with trainer_shared_dir from
its last record checkpoint (on that volume), every other task, a chunk without it
included (its records are on the lost pod's disk), from the beginning. Retries come
in two kinds under the one deadline: the task's own (task_retries, for the faults its code
calls transient) and propeller's after a system failure (a lost node, an eviction), up to
SYSTEM_RETRIES. The budget prices the worst case: every retry of both kinds, each attempt
failing just before it would have ended.

Work is priced by the cost model (dapo.cluster.cluster_cost) at its high end (fsspec's 120 MiB/s
per client, cold engine starts), a step's compute from measured_step_minutes or the
model's estimate, with HEADROOM for what a model misses. Left out: time in the queue,
image pulls, and the generation of a validation (its download and engine start count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dapo.cluster import cluster_cost as cost
from dapo.config import ConfigError, DAPOConfig
from dapo.execution.schedule import chunk_ranges

HEADROOM = 1.2
"""Timeouts must exceed the priced work by this factor."""

SYSTEM_RETRIES = 3
"""Propeller's retries of a node after system failures (node-config.max-node-retries-system-failures
in k8s/flyte-binary-values.yaml, Flyte's default), counted apart from task_retries."""


@dataclass(frozen=True)
class TaskBudget:
    """One kind of task's timeout against its work."""

    task: str
    timeout_field: str
    """The DAPOConfig field that sets its timeout."""
    timeout_minutes: int
    attempt_s: float
    """One whole attempt's work."""
    retry_s: float
    """A retry's work, from where the task restarts."""
    retries: int
    """The task's own retries (task_retries); SYSTEM_RETRIES come on top."""
    work: str
    """What the attempt is made of, for the messages."""

    @property
    def all_attempts_s(self) -> float:
        """The first attempt and every retry of both kinds, each failing just before it would have ended."""
        return self.attempt_s + (self.retries + SYSTEM_RETRIES) * self.retry_s

    @property
    def needed_minutes(self) -> int:
        """The smallest timeout that covers an attempt, and (twice over) every attempt."""
        return math.ceil(max(self.attempt_s, self.all_attempts_s / 2) * HEADROOM / 60)

    def problem(self) -> str:
        """An empty string when the timeout covers the work, else what is wrong, naming the field and the numbers."""
        if not self.timeout_minutes or self.timeout_minutes >= self.needed_minutes:
            return ""
        return (
            f"cluster.{self.timeout_field}={self.timeout_minutes}: {self.task} needs "
            f"~{self.attempt_s / 60:,.0f} min an attempt ({self.work}) "
            f"and ~{self.all_attempts_s / 60:,.0f} min with its "
            f"{self.retries} retries and propeller's {SYSTEM_RETRIES} after system failures, which Flyte ends at "
            f"twice the timeout; with {HEADROOM}x headroom set "
            f"{self.timeout_field} >= {self.needed_minutes}"
        )


VERL_STEP_TOKENS = 1536 * 16 * (2048 + 20480)
"""The most tokens one of verl's 32B DAPO steps samples in a round: 1,536 prompts x G=16 x
(prompt + response) lengths (recipe/dapo/run_dapo_qwen2.5_32b.sh, our paper_32b)."""


def step_seconds(config: DAPOConfig) -> float:
    """A step's wall time without restarts: measured_step_minutes, else the cost model's
    estimate (verl's 32B step scaled by parameters per GPU) scaled again by the tokens a
    round may sample against verl's (prompts a round x G x (L_prompt + L_max)): compute
    follows tokens, and a config with shorter responses or fewer prompts does less."""
    if config.measured_step_minutes:
        return config.measured_step_minutes * 60
    tokens = (
        config.prompts_per_round * config.n_samples_per_prompt * (config.max_prompt_length + config.max_response_length)
    )
    return cost.compute_s(cost.Model.of(config)) * tokens / VERL_STEP_TOKENS


def longest_chunk(config: DAPOConfig) -> int:
    return max(last - first for first, last in chunk_ranges(config))


def task_budgets(config: DAPOConfig) -> list[TaskBudget]:
    """Every kind of cluster task of the config's run, priced."""
    model, scenario = cost.Model.of(config), cost.HIGH
    step = step_seconds(config)
    weights = cost.transfer_s(model.weights_bytes, scenario)
    engine_start = cost.vllm_start_s(model, scenario)
    _, trainer_restart = cost.trainer_restart(model, scenario)
    retries = config.task_retries

    def budget(
        task: str, seconds: float, work: str, retry_s: float | None = None, field: str = "stage_timeout_minutes"
    ) -> TaskBudget:
        timeout = getattr(config, field)
        return TaskBudget(task, field, timeout, seconds, seconds if retry_s is None else retry_s, retries, work)

    budgets = [
        budget("bootstrap_policy", 2 * weights, f"the weights down and up, {2 * weights / 60:.0f} min"),
        budget("evaluate", weights + engine_start, "the weights down and a vLLM start; its generation is not priced"),
        budget("register_model", 2 * weights, f"the weights down and up, {2 * weights / 60:.0f} min"),
    ]
    restarts = f"{trainer_restart / 60:.0f} min to load, start and save the trainer"
    if config.execution == "colocated":
        steps, every = longest_chunk(config), config.colocated_checkpoint_every
        per_step = step + cost.sync_s(model, scenario)
        record = model.checkpoint_bytes / model.nodes / scenario.save_bytes_s

        def chunk(n: int) -> float:
            return trainer_restart + engine_start + n * per_step + (math.ceil(n / every) - 1) * record

        field = "chunk_timeout_minutes" if config.chunk_timeout_minutes else "stage_timeout_minutes"
        # records on trainer_shared_dir outlive a pod; without it they are on the lost pod's disk
        redone = min(every, steps) if config.trainer_shared_dir else steps
        resumes = (
            f"a retry resumes from its last record, <= {redone} steps back"
            if redone < steps
            else "a retry starts it again"
        )
        budgets.append(
            budget(
                "a colocated chunk",
                chunk(steps),
                f"{steps} steps of {per_step / 60:.1f} min (steps_per_chunk, val_every) + {restarts}; " + resumes,
                retry_s=chunk(redone),
                field=field,
            )
        )
    else:
        update, generate = cost.UPDATE_SHARE * step, (1 - cost.UPDATE_SHARE) * step
        budgets.append(budget("policy_step", trainer_restart + update, f"{update / 60:.1f} min of update + {restarts}"))
        budgets.append(
            budget(
                "rollout",
                weights + engine_start + generate,
                f"{generate / 60:.1f} min of generation + the weights down and a vLLM start",
            )
        )
    return budgets


def check_run_budget(config: DAPOConfig) -> None:
    """Raise ConfigError naming every timeout that does not cover its task's work; nothing to
    check without a model size (the embedded policy) or without a timeout.

    Called by the run's resolver (dapo.resolve.resolve_run) and `python -m dapo config`, not by the
    config's own validation: the schema stays plain data, below the cost model that reads it."""
    if not config.model_size_billions or not (config.stage_timeout_minutes or config.chunk_timeout_minutes):
        return
    problems = [problem for problem in (b.problem() for b in task_budgets(config)) if problem]
    if problems:
        where = "measured_step_minutes" if config.measured_step_minutes else "the cost model's step estimate"
        raise ConfigError("; ".join(problems) + f" (a step of {step_seconds(config) / 60:.1f} min from {where})")


def budget_lines(config: DAPOConfig) -> list[str]:
    """The budget as a markdown table."""
    rows = [
        "| task | timeout field | timeout min | attempt min | with retries min | needs min |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for b in task_budgets(config):
        rows.append(
            f"| {b.task} | {b.timeout_field} | {b.timeout_minutes} | {b.attempt_s / 60:,.0f} "
            f"| {b.all_attempts_s / 60:,.0f} | {b.needed_minutes:,} |"
        )
    return rows
