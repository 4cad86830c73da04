"""What an evaluation is asked (EvalSettings, the drafters, the prompts) and what decoding returns
(Generation)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import EvaluationError
from draftsmith.io import read_jsonl
from draftsmith.settings import StageSettings, check_settings, from_schema

log = logging.getLogger(__name__)


DRAFTER_KINDS = ("eagle3", "ngram", "target")


@dataclass(frozen=True)
class EvalSettings(StageSettings):
    """The eval section of the config, and the target's engine (its dtype, the device, vLLM's tensor
    parallel size); defaults and ranges from the schema.

    ``sweep_max_prompts`` bounds the prompts used for the τ-against-k sweep (replayed on their
    greedy text: ``evaluate.replay``); the configured ``k`` always runs on all ``max_prompts`` prompts. acceptance.json
    records the eval section's settings; what the engine ran on is its ``device`` entry.
    """

    backend: str = from_schema("eval.backend")
    hf_check: bool = from_schema("eval.hf_check")
    separate_engines: bool = from_schema("eval.separate_engines")  # vLLM's greedy and n-gram runs in engines of their own
    enforce_eager: bool = from_schema("eval.enforce_eager")  # vLLM without CUDA graphs on a GPU
    k: int = from_schema("eval.k")
    k_sweep: tuple[int, ...] = from_schema("eval.k_sweep")
    max_prompts: int = from_schema("eval.max_prompts")
    max_new_tokens: int = from_schema("eval.max_new_tokens")
    ngram_max: int = from_schema("eval.ngram_max")
    sweep_max_prompts: int = from_schema("eval.sweep_max_prompts")
    model_dtype: str = from_schema("target.dtype")  # dtype the target runs in; auto = bf16 on GPU, fp32 on CPU
    device: str = from_schema("device")
    tensor_parallel_size: int = from_schema("extraction.tensor_parallel_size")  # vLLM's; the HF loop uses one device

    SECTION = "eval"
    NOT_SETTINGS = {"sources": "the rule's inputs (evaluate_draft's sources argument)",
                    "payoff": "estimate_payoff's own settings (draftsmith.payoff.PayoffSettings)"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_sweep", tuple(sorted(set(self.k_sweep))))
        check_settings(self)


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]
    source: str = ""  # the data file the held-out prompt came from (heldout.jsonl's source.file)


@dataclass(frozen=True)
class DrafterSpec:
    """Which drafter to run, in terms any backend can translate (a vLLM backend would map these to
    its speculative_config; the hf backend builds a ``Drafter``)."""

    kind: str  # eagle3 | ngram | target
    path: str | None = None  # eagle3: the speculators-format draft folder
    ngram_max: int = 3  # ngram: longest suffix matched

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise EvaluationError(f"unknown drafter kind {self.kind!r}", fix="use one of " + ", ".join(DRAFTER_KINDS))

    def describe(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "eagle3":
            out["path"] = self.path
        if self.kind == "ngram":
            out["ngram_max"] = self.ngram_max
        return out


@dataclass
class Generation:
    """One prompt decoded once: the generated tokens (stop token included), wall-clock seconds,
    and for speculative runs the accepted and proposed draft tokens of each verification step."""

    prompt_id: str
    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)


def read_prompts(heldout_jsonl: str | Path, max_prompts: int | None = None) -> list[Prompt]:
    """The first ``max_prompts`` held-out prompts (heldout.jsonl rows: id, prompt_ids, ...)."""
    prompts = []
    for lineno, row in read_jsonl(heldout_jsonl, error=EvaluationError, fix="rerun prepare_dataset"):
        try:
            source = row.get("source")
            prompt = Prompt(str(row["id"]), [int(t) for t in row["prompt_ids"]],
                            str(source.get("file", "")) if isinstance(source, dict) else "")
        except (KeyError, TypeError, ValueError) as e:
            raise EvaluationError(f"not a held-out prompt row: {type(e).__name__}: {e}",
                                  where=f"{heldout_jsonl}:{lineno}", fix="rerun prepare_dataset") from e
        if not prompt.ids:
            raise EvaluationError("the held-out prompt is empty", where=f"{heldout_jsonl}:{lineno}",
                                  fix="rerun prepare_dataset")
        prompts.append(prompt)
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    return prompts
