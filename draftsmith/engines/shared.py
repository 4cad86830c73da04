"""One engine for capture and evaluation (and regeneration): the run's target loaded once for them.

Capture needs its engine eager, without prefix caching or chunked prefill, with the capture hooks'
worker extension; evaluation needs the draft as the engine's EAGLE-3 speculator, which vLLM fixes
when the engine starts, before the draft is trained. So when both stages run in vLLM, the capture
engine starts with a speculator slot: a draft of the architecture training will produce (the same
target, draft settings and vocabulary size), random weights, built by the engine process
(``draftsmith.engines.service``) in its own folder. Capture never decodes past the prefill, so the
slot costs it the draft's prefill over each prompt and its k - 1 proposal steps, never a
verification. Evaluation attaches to the same warm engine (its key is
the same: ``SharedEngine`` gives both stages identical engine arguments) and loads the trained
draft's weights into the slot in place (``draftsmith_load_draft`` in the worker extension); a draft
of another architecture, or a context the engine was not sized for, gets an engine of its own.

Greedy regeneration in vLLM shares the engine too where it would run eager anyway
(``regenerate.enforce_eager``, or the CPU build), so that a run loads the target once: it starts the
engine, and the slot costs each of its decode steps the draft's ``k`` proposals and their
verification (vLLM's speculative decoding is lossless, so the answers are the target's). The
context then also holds ``regeneration_context`` positions (``data.max_seq_len`` plus
``regenerate.max_new_tokens``), so every turn that can be trained gets its whole answer. With CUDA
graphs regeneration keeps an engine of its own: the shared engine is eager, and a large regeneration
decodes about twice as fast with graphs. So does sampled regeneration: its draws would depend on the
slot's proposals (random weights, or a trained draft evaluation loaded), so a resumed run would not
draw what an uninterrupted one drew.

The capture engine's arguments are built here (``capture_engine_args``), by every stage that uses
the engine alike: equal arguments are what makes it one engine (the warm engine's key).

Which engine capture and evaluation attach to is read from the config, never a rule's parameter:
it decides no result (capture's states and the served tokens are checked as always). Regeneration's
chunks, and its rule, are keyed by the context it decoded in here (``regeneration_context``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from draftsmith.targets.vllm_compat import engine_kwargs, platform_workarounds

log = logging.getLogger(__name__)

WORKER_EXTENSION = "draftsmith.extract.vllm_worker.CaptureWorkerExtension"
DEFAULT_TOKEN_BUDGET = 8192  # rows per forward pass unless max_model_len needs more
# Engine arguments the shared engine sets for every stage in it: its context (enough for each), eager
# (capture's hooks are Python), capture's batching; a stage's own values of them do not apply there.
SET_BY_THE_SHARED_ENGINE = frozenset({"max_model_len", "enforce_eager", "max_num_seqs", "max_num_batched_tokens",
                                      "language_model_only"})


@dataclass(frozen=True)
class SharedEngine:
    """What makes the capture engine also the evaluation's (and regeneration's, with ``regeneration``):
    its context (enough for the longest sample, the longest prompt plus its answer, and a regenerated
    turn), the speculator's ``k``, and the slot's draft."""

    max_model_len: int
    speculative_tokens: int
    slot: dict  # what the engine process builds the slot's draft from: target.json, draft settings, vocabulary
    regeneration: int | None = None  # regeneration_context(config) where regeneration runs in it too

    @property
    def speculator_slot(self) -> dict:
        """``open_llm``'s description of the engine's speculator slot."""
        return {"slot": self.slot, "num_speculative_tokens": self.speculative_tokens}

    def slot_engine(self, model_path: str, *, tensor_parallel_size: int, dtype: str, trust_remote_code: bool,
                    **llm_kwargs) -> tuple[dict, dict]:
        """The engine's arguments and its slot as a stage that attaches to it (evaluation,
        regeneration) names them: capture's own, so that all name the same engine. ``llm_kwargs``:
        the stage's other engine arguments, less those the shared engine sets itself
        (``SET_BY_THE_SHARED_ENGINE``), whatever the stage's own engine would have taken."""
        own = {k: v for k, v in llm_kwargs.items() if k not in SET_BY_THE_SHARED_ENGINE}
        return (capture_engine_args(model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                    max_model_len=self.max_model_len, trust_remote_code=trust_remote_code,
                                    shared=self, **own), self.speculator_slot)

    @classmethod
    def from_config(cls, config: Mapping, target_json: str | Path) -> SharedEngine | None:
        """The shared engine of this run, or None where capture and evaluation do not share one:
        either stage outside vLLM, evaluation's three-engine cross-check, engines that die with
        their job (``warm_target.minutes: 0``, SLURM, a target too large for the machine's memory
        asleep), or a target vLLM cannot draft for."""
        import os

        from draftsmith.engines.warm import too_large_to_keep
        from draftsmith.io import read_json

        evaluation, extraction = config["eval"], config["extraction"]
        if not _may_share(config) or os.environ.get("SLURM_JOB_ID"):
            return None
        target = read_json(target_json)
        support = (target.get("backends") or {}).get("vllm") or {}
        if not support.get("supported") or support.get("supports_eagle3") is False:
            return None
        too_large = too_large_to_keep(target["model_path"])
        if too_large:
            log.warning("%s: capture and evaluation load the target each in their own engine", too_large)
            return None
        env = config.get("engine_env") or {}
        if (env.get("extract_hidden_states") or {}) != (env.get("evaluate_draft") or {}):
            log.warning("engine_env gives extract_hidden_states and evaluate_draft other variables: their engines "
                        "differ, so evaluation loads the target again")
            return None
        samples = max(int(config["data"]["max_seq_len"]), int(extraction.get("max_model_len") or 0) - 1)
        context = samples + int(evaluation["max_new_tokens"]) + int(evaluation["k"]) + 1
        regeneration = regeneration_context(config)
        if regeneration:
            context = max(context, regeneration)
        limit = (target.get("text_config") or {}).get("max_position_embeddings")
        if limit:  # vLLM refuses more than the model's own; evaluation checks its prompts against this
            context = min(context, int(limit))
        draft, train = config["draft"], config["train"]
        slot = {
            "target": {k: target[k] for k in ("model_path", "architecture", "hidden_size", "vocab_size",
                                              "aux_layer_ids", "text_config") if k in target},
            "draft": {"variant": draft["variant"], "num_layers": draft["num_layers"],
                      "speculative_tokens": train["ttt_steps"]},
            "draft_vocab_size": min(int(config["vocab"]["draft_vocab_size"]), int(target["vocab_size"])),
        }
        return cls(context, int(evaluation["k"]), slot, regeneration)

    @classmethod
    def for_regeneration(cls, config: Mapping, target_json: str | Path) -> SharedEngine | None:
        """The shared engine where regeneration decodes in it, else None (an engine of its own)."""
        return cls.from_config(config, target_json) if regeneration_context(config) else None


def _may_share(config: Mapping) -> bool:
    """What the config alone says of a shared engine: capture and evaluation both in vLLM, without
    evaluation's three-engine cross-check, the engines kept warm."""
    evaluation = config["eval"]
    return (config["extraction"]["backend"] == "vllm" and evaluation["backend"] == "vllm"
            and not evaluation["separate_engines"] and bool((config.get("warm_target") or {}).get("minutes")))


def regeneration_context(config: Mapping) -> int | None:
    """The positions regeneration's answers get in the shared engine (``data.max_seq_len`` plus
    ``regenerate.max_new_tokens``: every turn that starts inside a training sample gets its whole
    answer), or None where it decodes in an engine of its own: not in vLLM, sampled, on CUDA graphs,
    with another engine environment than extraction's, or with no engine to share. Read from the config
    alone, so that the rule keys its output by it (a longer ``data.max_seq_len`` regenerates); a job
    may still find no shared engine (a target too large to keep warm, SLURM) and use its own."""
    from draftsmith.targets.vllm_install import vllm_cpu_build

    regenerate = config.get("regenerate") or {}
    if not regenerate.get("enabled") or regenerate.get("backend") != "vllm" or regenerate.get("temperature"):
        return None
    if not (regenerate.get("enforce_eager") or vllm_cpu_build()) or not _may_share(config):
        return None
    env = config.get("engine_env") or {}
    if (env.get("regenerate_responses") or {}) != (env.get("extract_hidden_states") or {}):
        return None
    return int(config["data"]["max_seq_len"]) + int(regenerate["max_new_tokens"])


def capture_engine_args(model_path: str, *, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                        max_model_len: int, trust_remote_code: bool = False, language_model_only: bool = True,
                        max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET, shared: SharedEngine | None = None,
                        **llm_kwargs) -> dict:
    """The ``LLM`` arguments of a capture engine (``draftsmith.extract.vllm_backend``), as the
    installed vLLM takes them. With ``shared`` it is also evaluation's (and regeneration's) engine:
    sized for them, recording what serving reads (spec-decode metrics, raw logits)."""
    if shared is not None:
        max_model_len = max(int(max_model_len), shared.max_model_len)
    kwargs = dict(
        model=str(model_path), tensor_parallel_size=tensor_parallel_size, dtype=dtype,
        max_model_len=int(max_model_len), trust_remote_code=trust_remote_code,
        enforce_eager=True,                 # hooks must run as Python, not be traced by torch.compile
        enable_prefix_caching=False,        # every prompt row must be computed
        enable_chunked_prefill=False,       # a prompt's rows all lie in one forward pass
        max_num_batched_tokens=max(int(max_num_batched_tokens), int(max_model_len)),
        async_scheduling=False,             # no speculative extra steps beside the prefills
        worker_extension_cls=WORKER_EXTENSION,
        language_model_only=language_model_only,  # text-only capture: no vision encoder in memory
        seed=0,
    )
    if shared is not None:
        kwargs.update(disable_log_stats=False, per_request_spec_decode_metrics="detailed", logprobs_mode="raw_logits")
    kwargs.update(platform_workarounds(kwargs))
    kwargs.update(llm_kwargs)
    return engine_kwargs(kwargs)
