"""One engine for capture and evaluation: the run's target loaded once for both.

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

Regeneration keeps an engine of its own: on a speculator slot with random weights every decode
step would verify ``k`` drafts that are never accepted.

Everything here is read from the config, never a rule's parameter: which engine a stage attaches to
decides no result (capture's states and the served tokens are checked as always), so a change here
reruns nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedEngine:
    """What makes the capture engine also the evaluation's: its context (enough for the longest
    sample and the longest prompt plus its answer), the speculator's ``k``, and the slot's draft."""

    max_model_len: int
    speculative_tokens: int
    slot: dict  # what the engine process builds the slot's draft from: target.json, draft settings, vocabulary

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
        if extraction["backend"] != "vllm" or evaluation["backend"] != "vllm" or evaluation["separate_engines"]:
            return None
        if not (config.get("warm_target") or {}).get("minutes") or os.environ.get("SLURM_JOB_ID"):
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
        return cls(context, int(evaluation["k"]), slot)
