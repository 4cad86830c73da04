"""Generate answers with vLLM's offline engine (``LLM.generate``), for regeneration at full tensor
parallelism.

Only vLLM's public API is used (``LLM``, ``SamplingParams``, ``TokensPrompt``), which every
supported release provides, through ``draftsmith.engines.plain`` (the requests as plain data, so a
job attached to a warm engine imports no vLLM); the engine arguments are built in one place
(``engine_args``) and pass through the version table of :mod:`draftsmith.targets.vllm_compat`.

Sampling is mapped one to one from the regenerate settings: ``temperature`` (0 = greedy),
``top_p``, ``max_new_tokens`` -> ``max_tokens``, and the run's seed -> a per-request ``seed``
derived like the HF path's batch seeds, so a resumed chunk draws what an uninterrupted one would
have drawn. The model folder's generation_config.json is ignored (``generation_config="vllm"``), as
the HF path replaces it: "greedy" means argmax, "temperature t" only that. Generation stops at
exactly the stop set given (``ignore_eos`` plus ``stop_token_ids``), as HF's ``eos_token_id``.

vLLM is imported only where an engine loads in this process, so this module imports without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from draftsmith.engines.warm import open_llm
from draftsmith.errors import TargetError
from draftsmith.targets.vllm_compat import engine_kwargs, platform_workarounds
from draftsmith.targets.vllm_install import installed_vllm_version, vllm_device_type

log = logging.getLogger(__name__)


def engine_args(model_path: str, *, tensor_parallel_size: int = 1, dtype: str = "auto",
                trust_remote_code: bool = False, max_num_seqs: int | None = None,
                max_model_len: int | None = None, enforce_eager: bool = False, **overrides) -> dict:
    """Every argument the regeneration engine is built with, as the installed vLLM takes them;
    ``enforce_eager`` runs it without torch.compile and CUDA graphs on a GPU too."""
    args = dict(
        model=str(model_path), tokenizer=str(model_path), tensor_parallel_size=int(tensor_parallel_size),
        dtype=dtype, trust_remote_code=bool(trust_remote_code), max_model_len=max_model_len,
        generation_config="vllm",       # the model's sampling defaults would change what "greedy" means
        seed=0,
        # On the CPU torch.compile costs half a minute per engine and gains nothing.
        enforce_eager=enforce_eager or vllm_device_type() == "cpu",
    )
    if max_num_seqs is not None:
        args["max_num_seqs"] = int(max_num_seqs)
    args.update(platform_workarounds(args))
    args.update(overrides)
    return engine_kwargs(args)


class VllmGenerator:
    """The target loaded once in vLLM; ``generate`` returns the new token ids of each prompt."""

    def __init__(self, model_path: str, *, slot_engine: tuple[dict, dict] | None = None, **kwargs) -> None:
        """``kwargs`` are ``engine_args``'; or ``slot_engine`` (complete engine arguments and the slot of
        ``engines.shared``) names the run's shared engine, whose speculator (random weights, never
        trusted: vLLM verifies every drafted token) regeneration decodes through."""
        if installed_vllm_version() is None:  # not imported here: a warm engine imports it
            raise TargetError("vLLM is not installed in this environment", where="regenerate.backend",
                              fix="run in the vLLM environment (envs/vllm.yaml, or scripts/setup.sh --cuda) "
                                  "or set regenerate.backend: hf")
        self.args, slot = slot_engine if slot_engine is not None else (engine_args(model_path, **kwargs), None)
        # An in-process CPU engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) replaces torch.set_num_threads
        # with a no-op; close() puts it back.
        self._set_num_threads = torch.set_num_threads
        role = ("eager, shared with capture and evaluation" if slot is not None
                else "eager" if self.args.get("enforce_eager") else "CUDA graphs")
        try:
            self.engine = open_llm(self.args, what=f"vLLM generation engine (TP {self.args['tensor_parallel_size']}, "
                                                   f"{role})", set_num_threads=self._set_num_threads,
                                   speculator_slot=slot)
        except Exception as e:
            torch.set_num_threads = self._set_num_threads
            raise TargetError(f"vLLM cannot load {model_path}: {type(e).__name__}: {e}", where=str(model_path),
                              fix="see docs/adapting-a-target.md (vLLM versions and known limits), "
                                  "or set regenerate.backend: hf for a target that fits one device") from e
        self.llm = self.engine.llm
        self.max_model_len = self.engine.max_model_len
        self.load_seconds = self.engine.load_seconds
        log.info("vLLM %s %s (tensor_parallel_size %d, max_model_len %d)",
                 "loaded" if self.engine.loaded else "attached to", model_path, self.args["tensor_parallel_size"],
                 self.max_model_len)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                 temperature: float = 0.0, top_p: float = 1.0, seeds: Sequence[int] | None = None
                 ) -> list[list[int] | None]:
        """New tokens per prompt, in prompt order, all prompts in one call (vLLM batches them).

        A prompt too long for the engine's context gets as many new tokens as fit; one that leaves
        no room, None.
        """
        greedy = temperature == 0
        params, inputs, fits = [], [], []
        short = [len(ids) for ids in prompts if self.max_model_len - len(ids) < max_new_tokens]
        if short:
            log.warning("%d of %d prompts (up to %d tokens) leave less than max_new_tokens=%d in the engine's %d "
                        "positions: their answers are cut, or not written where nothing fits", len(short),
                        len(prompts), max(short), max_new_tokens, self.max_model_len)
        for n, ids in enumerate(prompts):
            room = self.max_model_len - len(ids)
            if room < 1:
                continue  # nothing fits: the caller leaves the turn as it was
            fits.append(n)
            params.append(dict(
                max_tokens=min(max_new_tokens, room), temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p, seed=None if greedy or seeds is None else int(seeds[n]),
                ignore_eos=True, stop_token_ids=[int(t) for t in stop_ids], detokenize=False))
            inputs.append([int(t) for t in ids])
        out: list[list[int] | None] = [None for _ in prompts]
        if inputs:
            for n, output in zip(fits, self.llm.generate(inputs, params)):
                out[n] = output.token_ids
        return out

    def close(self) -> None:
        self.llm = None
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> VllmGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

