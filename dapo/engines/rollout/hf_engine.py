"""Hugging Face transformers `generate` backend: the fallback where vLLM is missing.

Same outputs as the vLLM backend (see `dapo.engines.rollout.base` for the conventions).
Rows are the prompts repeated n times, left-padded, generated in chunks of at most
`max_batch_rows` rows. Log-probs come from `output_scores`, which transformers
returns after its logits processors (temperature, then top-p), so
log_softmax(scores) at the sampled token is the log-prob under the distribution
sampled from, as vLLM's "processed_logprobs".

Determinism: each chunk samples under torch.random.fork_rng with a seed derived
from (settings.seed, first prompt of the chunk), so the caller's global RNG is not
touched and the same call gives the same completions. Unlike vLLM the samples do
depend on how the rows are chunked (sampling draws from one generator per chunk).
"""

from __future__ import annotations

import logging

import torch

from dapo.engines.rollout.base import (
    Completion,
    ProgressFn,
    RolloutEngine,
    SamplingSettings,
    iter_safetensors,
    request_seed,
)

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class HFRolloutEngine(RolloutEngine):
    backend = "hf"

    def _open(self, *, device: str | None = None, max_batch_rows: int = 256) -> None:
        """device: where the model runs (default cuda if there is one); max_batch_rows: the most
        rows (prompt x sample) one generate call takes."""
        if self.settings.tensor_parallel_size != 1:
            logger.warning(
                "the hf rollout backend runs on one device; ignoring tensor_parallel_size=%d",
                self.settings.tensor_parallel_size,
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_batch_rows = int(max_batch_rows)
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        )
        self.model = self._load_model(self.model_dir)

    def _load_model(self, model_dir: str):
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch_dtype = TORCH_DTYPES.get(self.settings.dtype, "auto")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        # Only SamplingSettings decide sampling: drop the checkpoint's defaults (top_k, penalties, ...).
        model.generation_config = GenerationConfig(eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id)
        return model.to(self.device).eval()

    # --- generation -----------------------------------------------------------
    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, progress: ProgressFn | None
    ) -> list[Completion]:
        n = sampling.n
        total = len(prompt_token_ids) * n
        prompts_per_chunk = max(1, self.max_batch_rows // n)
        completions: list[Completion] = []
        for start in range(0, len(prompt_token_ids), prompts_per_chunk):
            chunk = prompt_token_ids[start : start + prompts_per_chunk]
            completions.extend(self._generate_chunk(chunk, start, sampling))
            if progress is not None:
                progress(len(completions), total)
        return completions

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], first_index: int, sampling: SamplingSettings
    ) -> list[Completion]:
        from transformers import GenerationConfig

        n = sampling.n
        rows = [ids for ids in prompts for _ in range(n)]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        # vLLM caps a request at max_model_len tokens in all: so does this backend, per row.
        limits = [min(sampling.max_tokens, self.settings.max_model_len - len(ids)) for ids in rows]
        config = GenerationConfig(
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=None if sampling.greedy else 0,
            max_new_tokens=max(limits),
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(request_seed(sampling.seed, first_index, -1))
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )
        generated = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float()  # (rows, steps, vocab), after temperature / top-p
        log_probs = (
            torch.log_softmax(scores, dim=-1).gather(-1, generated.to(scores.device).unsqueeze(-1)).squeeze(-1).cpu()
        )

        stops = set(self.stop_token_ids)
        token_lists, lp_lists, reasons = [], [], []
        for row in range(len(rows)):
            tokens = generated[row].tolist()
            end, reason = limits[row], "length"
            for position, token in enumerate(tokens[: limits[row]]):
                if token in stops:
                    end, reason = position + 1, "stop"
                    break
            token_lists.append(tokens[:end])
            lp_lists.append(log_probs[row, :end].tolist())
            reasons.append(reason)
        texts = self.decode(token_lists)
        return [
            Completion(
                prompt_index=first_index + row // n,
                sample_index=row % n,
                prompt_token_ids=list(rows[row]),
                token_ids=token_lists[row],
                text=texts[row],
                log_probs=lp_lists[row],
                finish_reason=reasons[row],
            )
            for row in range(len(rows))
        ]

    # --- weights and lifetime -------------------------------------------------
    def _load_weights(self, checkpoint_dir: str) -> None:
        if not self._copy_into_parameters(dict(iter_safetensors(checkpoint_dir))):
            # Other key layouts (tied embeddings, renamed modules): let transformers map them.
            logger.info(
                "%s: keys differ from the live model's parameters; reloading with from_pretrained", checkpoint_dir
            )
            self.model = self._load_model(checkpoint_dir)

    def _load_tensors(self, named_tensors) -> None:
        if not self._copy_into_parameters(dict(named_tensors)):
            raise ValueError("the tensors' names are not the live model's parameter names")

    def _copy_into_parameters(self, state: dict) -> bool:
        """Copy state into the live parameters if it names exactly them; False (nothing copied) otherwise."""
        params = dict(self.model.named_parameters())
        if set(state) != set(params):
            return False
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name].to(dtype=param.dtype, device=param.device))
        return True

    def _close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
