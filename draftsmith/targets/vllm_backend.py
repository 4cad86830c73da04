"""Capture hidden states with vLLM: prefill-only requests, forward hooks in the workers.

Each sample is one request with ``max_tokens=1``, so the model runs exactly the prompt's prefill
(the one sampled token is never fed back). Prefix caching is off: a cached prefix is never
computed, so its rows would be missing. Chunked prefill may stay on: the worker places each
chunk's rows by their positions. vLLM must run eagerly (``enforce_eager=True``) so the Python
hooks run as written. The hooks live in :mod:`draftsmith.targets.vllm_worker`; states come back
to this process through ``LLM.collective_rpc`` (from TP rank 0; every TP rank holds the full
hidden states), whether vLLM runs its engine in this process or in worker processes.

vLLM is imported only when a backend is created, so this module imports without it.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from draftsmith.errors import ExtractionError
from draftsmith.targets.backends import CaptureBackend

log = logging.getLogger(__name__)

WORKER_EXTENSION = "draftsmith.targets.vllm_worker.CaptureWorkerExtension"
_instances = itertools.count()


class VllmBackend(CaptureBackend):
    """Loads the target once in vLLM; ``capture`` returns per sample {layer id: [len, hidden] CPU tensor}."""

    name = "vllm"

    def __init__(self, model_path: str, capture_layer_ids: list[int], *, tensor_parallel_size: int = 1,
                 dtype: str = "bfloat16", max_model_len: int, trust_remote_code: bool = False,
                 layers_path: str | None = None, language_model_only: bool = True, **llm_kwargs) -> None:
        self.layer_ids = sorted(set(int(i) for i in capture_layer_ids))
        self.max_model_len = int(max_model_len)
        self._keys = (f"ds{next(_instances)}-{i}" for i in itertools.count())
        try:
            from vllm import LLM
        except ImportError as e:
            raise ExtractionError(f"vLLM cannot be imported: {e}", where="extraction.backend",
                                  fix="install vLLM (envs/vllm.yaml) or use extraction.backend: hf") from e
        if os.environ.get("VLLM_USE_V1") == "0":
            raise ExtractionError("the vLLM backend needs the V1 engine", where="VLLM_USE_V1",
                                  fix="unset VLLM_USE_V1")
        kwargs = dict(
            model=str(model_path), tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            max_model_len=self.max_model_len, trust_remote_code=trust_remote_code,
            enforce_eager=True,                 # hooks must run as Python, not be traced by torch.compile
            enable_prefix_caching=False,        # every prompt row must be computed
            async_scheduling=False,             # the hooks read the runner's step state during the forward
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )
        if language_model_only:  # text-only capture: no image processor, no vision encoder in memory
            kwargs["language_model_only"] = True
        kwargs.update(platform_workarounds())
        kwargs.update(llm_kwargs)
        if kwargs.get("enable_expert_parallel") and tensor_parallel_size > 1:
            raise ExtractionError("expert parallelism with tensor_parallel_size > 1 splits the residual stream "
                                  "across ranks (sequence-parallel MoE); the capture hooks need every row",
                                  where="vLLM engine arguments", fix="leave enable_expert_parallel off for extraction")
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU worker runs in this process and replaces
        # torch.set_num_threads with a no-op; close() puts it back.
        self._set_num_threads = torch.set_num_threads
        started = time.monotonic()
        self.llm = LLM(**kwargs)
        self.load_seconds = time.monotonic() - started
        try:
            infos = self.llm.collective_rpc("draftsmith_install", args=(self.layer_ids, layers_path))
        except Exception as e:
            self.close()
            raise ExtractionError(f"cannot hook the decoder layers inside vLLM: {e}", where=str(model_path),
                                  fix="set target.layers_path to vLLM's module path of the decoder layers "
                                      "(e.g. language_model.model.layers)") from e
        self.info = infos[0]
        log.info("vLLM loaded %s in %.1fs; hooked %s (%d layers, hidden %d) for layer ids %s",
                 model_path, self.load_seconds, self.info["layers_path"], self.info["num_layers"],
                 self.info["hidden_size"], self.layer_ids)

    def capture(self, batch: list[list[int]]) -> list[dict[int, torch.Tensor]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from draftsmith.targets.vllm_worker import decode_tensor

        if not batch:
            return []
        for n, ids in enumerate(batch):
            if not 0 < len(ids) < self.max_model_len:
                raise ExtractionError(f"sample {n} of the batch has {len(ids)} tokens; the vLLM backend takes "
                                      f"1..{self.max_model_len - 1} (max_model_len minus the one sampled token)",
                                      where="extraction.max_model_len", fix="raise max_model_len or drop long samples")
        keys = [next(self._keys) for _ in batch]
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in batch]
        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 extra_args={"draftsmith_capture": k}) for k in keys]
        try:
            self.llm.generate(prompts, params, use_tqdm=False)
            results = next(r for r in self.llm.collective_rpc("draftsmith_collect", args=(keys,))
                           if r is not None)
        except BaseException:
            self.llm.collective_rpc("draftsmith_reset")
            raise
        out = []
        for n, (key, ids) in enumerate(zip(keys, batch)):
            r = results[key]
            if r["error"]:
                raise ExtractionError(f"vLLM capture of sample {n} is incomplete: {r['error']}",
                                      where="vLLM backend")
            if list(r["token_ids"]) != list(map(int, ids)):
                raise ExtractionError(f"vLLM ran other tokens than sample {n} holds (a request-to-row mismatch)",
                                      where="vLLM backend")
            states = decode_tensor(r["states"])
            out.append({lid: states[k] for k, lid in enumerate(self.layer_ids)})
        return out

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_llm(llm, self._set_num_threads)


def platform_workarounds() -> dict:
    """Engine arguments that keep vLLM 0.32 exact on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # The CPU rotary kernel (RotaryEmbedding.forward_cpu -> torch.ops._C.rotary_embedding) rotates
        # 3-D [tokens, heads>1, dim] queries wrongly; MLA attention (DeepSeek) passes such queries.
        # The PyTorch-native rotary is exact.
        return {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
    return {}


def shutdown_llm(llm, set_num_threads) -> None:
    """Stop an engine's workers and free its memory; put back the torch.set_num_threads that an
    in-process CPU engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) replaced with a no-op."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    finally:
        del llm, engine, shutdown
        gc.collect()
        torch.set_num_threads = set_num_threads
