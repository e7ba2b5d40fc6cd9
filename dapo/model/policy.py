"""The embedded default policy: a tiny Qwen2 with its own tokenizer, built offline.

No hub download is possible (or wanted) for the default run, so the starting policy
is made here: a byte-level BPE tokenizer trained on the task's own text (digits
split one per token, as Qwen2's tokenizer does), a small Qwen2-architecture model
with untied embeddings (tied layouts are covered by dapo.model.policy_matrix and its tests), and a
short supervised warm start so that the policy solves a minority of problems:
groups are then mixed, and RL has signal.

The warm start is deliberately sloppy about the layout: in a share of its examples
(layout_noise) the final line is "The answer is N." instead of the "Answer: N" the
prompt asks for, which the verifier cannot credit. The policy starts out often
right and badly formatted, a flaw shared by every problem, so RL visibly fixes it
within minutes on a CPU, held-out problems included: the first thing RL teaches
base models in R1-Zero-style training too.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo.config import DAPO_PROMPT_TEMPLATE
from dapo.data.prompts import task_problem

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# The tiny tokenizer's chat template: the user turns verbatim, then a newline.
# (A bare newline after a block tag would be trimmed by the chat renderer's trim_blocks.)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}{% endif %}"
)


@dataclass
class TinyPolicySpec:
    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    warm_start_steps: int = 600
    warm_start_batch: int = 32
    warm_start_lr: float = 2e-3
    layout_noise: float = 0.6
    """Share of warm-start examples whose last line ignores the required answer layout (the
    embedded run's: DAPOConfig.embedded_layout_noise)."""
    task: str = "arithmetic"
    """The embedded task (dapo.config.EMBEDDED_TASKS) the policy is warm-started on."""
    verbose_share: float = 0.0
    """long_arithmetic: share of warm-start solutions in the wordy style (chain_response_text)."""
    seed: int = 0

    @classmethod
    def for_task(cls, task: str, warm_start_steps: int, layout_noise: float, seed: int = 0) -> TinyPolicySpec:
        """The embedded policy of a task. long_arithmetic's is warm-started with correct
        layouts (layout_noise unused), half of them wordy: its flaw for RL to fix is length."""
        if task == "long_arithmetic":
            return cls(task=task, layout_noise=0.0, verbose_share=0.5, warm_start_steps=warm_start_steps, seed=seed)
        return cls(task=task, warm_start_steps=warm_start_steps, layout_noise=layout_noise, seed=seed)


def response_text(problem: str, answer: str, required_layout: bool = True) -> str:
    """One worked line, then the answer: in the layout the DAPO prompt asks for, or not.

    Restating the operands next to the result keeps the arithmetic local, which a
    tiny model learns far faster than reaching back into the prompt for them.
    """
    expression = problem.removeprefix("What is ").removesuffix("?")
    last_line = f"Answer: {answer}" if required_layout else f"The answer is {answer}."
    return f"{expression} = {answer}\n{last_line}"


def chain_response_text(problem: str, answer: str, verbose: bool = False) -> str:
    """long_arithmetic's worked solution: the sum rewritten line by line with its first two
    terms added ("= 12 + 1 + 5"), until one number is left, then the answer. Every line
    only adds two numbers and copies the rest from the line above (local work a tiny model
    learns fast), and the solution grows with the square of the operands (3 operands ~20
    tokens, 7 ~85). The wordy style first restates the sum and ends with a recap line: the
    same arithmetic in ~3 tokens more per operand plus ~10."""
    terms = [int(t) for t in problem.removeprefix("What is ").removesuffix("?").split(" + ")]
    lines = [" + ".join(map(str, terms))] if verbose else []
    while len(terms) > 1:
        terms = [terms[0] + terms[1], *terms[2:]]
        lines.append("= " + " + ".join(map(str, terms)))
    if verbose:
        lines.append(f"So the sum is {terms[0]}.")
    lines.append(f"Answer: {answer}")
    return "\n".join(lines)


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE with single-digit tokens, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def warm_start_examples(
    rng: random.Random, n: int, layout_noise: float = 0.0, task: str = "arithmetic", verbose_share: float = 0.0
) -> list[tuple[str, str]]:
    """(prompt text, response text) pairs of an embedded task, all difficulty levels;
    arithmetic: a share layout_noise of them ends without the required answer layout;
    long_arithmetic: a share verbose_share of them is in the wordy style."""
    examples = []
    for _ in range(n):
        problem, answer = task_problem(task, rng)
        prompt = DAPO_PROMPT_TEMPLATE.format(problem=problem) + "\n"
        if task == "long_arithmetic":
            response = chain_response_text(problem, answer, verbose=rng.random() < verbose_share)
        else:
            response = response_text(problem, answer, required_layout=rng.random() >= layout_noise)
        examples.append((prompt, response))
    return examples


def build_tiny_policy(output_dir: str | Path, spec: TinyPolicySpec | None = None, progress=None) -> dict[str, float]:
    """Train the tokenizer, build the model, warm-start it and save both to output_dir.

    Returns warm-start metrics. progress, if given, is called as progress(step, total, loss).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyPolicySpec()
    output_dir = Path(output_dir)
    rng = random.Random(spec.seed)
    torch.manual_seed(spec.seed)
    started = time.perf_counter()

    corpus_pairs = warm_start_examples(rng, 2000, task=spec.task, verbose_share=spec.verbose_share)
    tokenizer = build_tokenizer([p + r for p, r in corpus_pairs], spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    losses = warm_start(model, tokenizer, rng, spec, progress)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return {
        "warm_start_loss_first": losses[0],
        "warm_start_loss_last": losses[-1],
        "warm_start_seconds": time.perf_counter() - started,
        "parameters": float(sum(p.numel() for p in model.parameters())),
    }


def warm_start(model, tokenizer, rng: random.Random, spec: TinyPolicySpec, progress=None) -> list[float]:
    """Supervised fine-tuning on response tokens only, cosine-decayed, deliberately short."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    losses = []
    model.train()
    for step in range(spec.warm_start_steps):
        pairs = warm_start_examples(rng, spec.warm_start_batch, spec.layout_noise, spec.task, spec.verbose_share)
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
        responses = [tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for _, r in pairs]
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        input_ids = torch.full((len(pairs), width), eos, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        attention_mask = torch.zeros_like(input_ids)
        for row, (p, r) in enumerate(zip(prompts, responses)):
            input_ids[row, : len(p) + len(r)] = torch.tensor(p + r)
            labels[row, len(p) : len(p) + len(r)] = torch.tensor(r)
            attention_mask[row, : len(p) + len(r)] = 1
        for group in optimizer.param_groups:
            group["lr"] = spec.warm_start_lr * 0.5 * (1 + math.cos(math.pi * step / spec.warm_start_steps))
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, spec.warm_start_steps, losses[-1])
    model.eval()
    return losses
