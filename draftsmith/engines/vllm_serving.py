"""Serve the target in vLLM, optionally with a speculator, and read back what vLLM reports.

This is how the trained draft is deployed: vLLM runs the target with the draft folder as its
EAGLE-3 speculator (``speculative_config={"method": "eagle3", "model": <draft>,
"num_speculative_tokens": k}``), greedy, from token ids. Where the release records them, each
request's output comes back with vLLM's own per-request record of its verification steps
(``per_request_spec_decode_metrics="detailed"``: accepted and proposed draft tokens per step;
:mod:`draftsmith.targets.vllm_compat` drops the argument where vLLM lacks it), and always the
engine's aggregate counters (``LLM.get_metrics()``, which needs ``disable_log_stats=False``)::

    vllm:spec_decode_num_drafts                   verification steps that had a draft
    vllm:spec_decode_num_draft_tokens             draft tokens proposed
    vllm:spec_decode_num_accepted_tokens          draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos  [k] steps whose draft token j was accepted

(vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/reader.py). The counters live in the process's
Prometheus registry and only grow, so a run's figures are the difference of two readings.

Requests and answers pass as plain data (``draftsmith.engines.plain``): vLLM is imported only
where an engine loads in this process, so this module, and a job attached to a warm engine, import
without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.engines.warm import open_llm
from draftsmith.errors import EvaluationError
from draftsmith.targets.vllm_compat import engine_kwargs, platform_workarounds
from draftsmith.targets.vllm_install import installed_vllm_version, vllm_device_type

log = logging.getLogger(__name__)

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def eagle3_config(draft_dir: str | Path, k: int) -> dict:
    """vLLM's speculative_config for the draft in ``draft_dir`` at ``k`` (the folder made absolute: a
    warm engine runs in a folder of its own)."""
    return {"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k}


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines), or their change over a run."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted_tokens - before.accepted_tokens,
                            _add(self.accepted_per_position, [-c for c in before.accepted_per_position]))

    def summary(self) -> dict:
        """τ = 1 + accepted / drafts (vLLM's mean acceptance length), the share of drafts whose
        token j was accepted, and the counts they come from."""
        d = self.drafts
        return {
            "tau": 1 + self.accepted_tokens / d if d else None,
            "acceptance_rate_by_position": [c / d if d else None for c in self.accepted_per_position],
            "draft_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "num_drafts": d,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted_tokens,
            "accepted_by_position": list(self.accepted_per_position),
        }


@dataclass
class Scored:
    """The target's own choice at each position of a served output (from the same engine's logits
    over prompt + output), and its greedy tokens after the output."""

    best: list[int]  # the argmax token at each output position
    best_logit: list[float]
    token_logit: list[float]  # the logit of the token the output holds there
    continuation: list[int]


@dataclass
class Served:
    """One prompt's output: generated tokens (a stop token included), and per verification step
    the draft tokens vLLM accepted and proposed (empty without a speculator; None where the vLLM
    release keeps no per-request record)."""

    tokens: list[int]
    accepted: list[int] | None
    proposed: list[int] | None


def counters_from_records(accepted: Sequence[Sequence[int]], proposed: Sequence[Sequence[int]], k: int
                          ) -> SpecCounters:
    """The counters vLLM would have kept for these per-request step records (accepted and proposed
    draft tokens per step that had a draft)."""
    steps = [(a, n) for acc, prop in zip(accepted, proposed) for a, n in zip(acc, prop)]
    return SpecCounters(len(steps), sum(n for _, n in steps), sum(a for a, _ in steps),
                        [sum(a >= j for a, _ in steps) for j in range(1, k + 1)])


def read_spec_counters(metrics) -> SpecCounters:
    """The spec-decode counters from ``get_metrics()`` (vLLM's metrics as ``plain.Metric``); zeros
    when vLLM recorded none yet."""
    out = SpecCounters()
    for metric in metrics:
        for attr, name in COUNTERS.items():
            if metric.name == name:
                setattr(out, attr, getattr(out, attr) + int(metric.value))
        if metric.name == PER_POSITION:
            out.accepted_per_position = _add(out.accepted_per_position, [int(v) for v in metric.values])
    return out


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


class VllmServer:
    """The target loaded once in vLLM (``LLM``), with ``speculative_config`` or without; or, given
    ``slot_engine`` (complete engine arguments and the slot of ``engines.shared``), the run's shared
    engine, whose speculator slot ``load_draft`` fills."""

    def __init__(self, model_path: str, *, speculative_config: dict | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, enforce_eager: bool = False,
                 slot_engine: tuple[dict, dict] | None = None, **llm_kwargs) -> None:
        if installed_vllm_version() is None:  # not imported here: a warm engine imports it
            raise EvaluationError("vLLM is not installed in this environment", where="eval.backend",
                                  fix="run in the vLLM environment (envs/vllm.yaml) or set eval.backend: hf")
        platform = vllm_device_type()
        cpu = platform == "cpu"
        self.speculative_config = dict(speculative_config) if speculative_config else None
        kwargs = dict(
            model=str(model_path), dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
            trust_remote_code=trust_remote_code, seed=0,
            # On the CPU torch.compile costs half a minute per engine and gains nothing; on a GPU
            # vLLM's default (compiled, CUDA graphs) is what a deployment runs, unless asked otherwise.
            enforce_eager=enforce_eager or cpu,
            disable_log_stats=False,        # LLM.get_metrics() needs the stat loggers
            language_model_only=True,       # text prompts: no vision tower in memory
        )
        kwargs.update(platform_workarounds(kwargs))
        if self.speculative_config:
            kwargs["speculative_config"] = self.speculative_config
            kwargs["per_request_spec_decode_metrics"] = "detailed"  # each output's accepted/proposed per step
        kwargs = engine_kwargs({**kwargs, **llm_kwargs})
        slot = None
        if slot_engine is not None:
            kwargs, slot = slot_engine
            self.speculative_config = {"method": "eagle3", "model": None,
                                       "num_speculative_tokens": slot["num_speculative_tokens"]}
        self.settings = {"platform": platform,
                         **{k: v for k, v in kwargs.items() if k not in ("model", "speculative_config")}}
        if slot is not None:  # eager, as capture's hooks need: its timings are not a deployment's
            self.settings["shared_with_capture"] = True
        # In-process CPU engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) replace torch.set_num_threads
        # with a no-op; close() puts it back.
        self._set_num_threads = torch.set_num_threads
        graphs = "eager" if kwargs.get("enforce_eager") else "CUDA graphs"
        role = "with the speculator " + self.speculative_config["method"] if self.speculative_config else "greedy"
        if slot is not None:
            role = "with a speculator slot, shared with capture"
        try:
            self.engine = open_llm(kwargs, what=f"vLLM serving engine, {role} (TP {kwargs.get('tensor_parallel_size', 1)}, "
                                                f"{graphs})", set_num_threads=self._set_num_threads, speculator_slot=slot)
        except Exception as e:
            torch.set_num_threads = self._set_num_threads
            what = f" with the speculator {self.speculative_config}" if self.speculative_config else ""
            raise EvaluationError(f"vLLM cannot serve {model_path}{what}: {type(e).__name__}: {e}",
                                  where=str(model_path),
                                  fix="see docs/adapting-a-target.md (vLLM versions and known limits)") from e
        self.llm = self.engine.llm
        self.load_seconds = self.engine.load_seconds
        log.info("vLLM %s %s (speculative_config %s)", "loaded" if self.engine.loaded else "attached to", model_path,
                 self.speculative_config)

    def counters(self) -> SpecCounters:
        return read_spec_counters(self.llm.get_metrics())

    def load_draft(self, draft_dir: str | Path) -> None:
        """Load the trained draft in ``draft_dir`` into the speculator slot, in place (its
        architecture must be the slot's: ``engine.slot`` holds the slot's draft folder)."""
        # the engine process has a working directory of its own
        self.llm.collective_rpc("draftsmith_load_draft", args=(str(Path(draft_dir).resolve()),))
        self.speculative_config["model"] = str(draft_dir)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> tuple[list[Served], SpecCounters, float]:
        """Greedy decoding of all ``prompts`` in one call (vLLM batches them): the outputs in prompt
        order, the change of the spec-decode counters over the call, and its wall-clock seconds.

        Generation stops at ``max_new_tokens`` or after any of ``stop_ids`` (kept in the output);
        the tokenizer's own EOS is ignored, so the stop set is exactly the one given.
        """
        params = dict(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                      stop_token_ids=[int(t) for t in stop_ids], detokenize=False)
        before = self.counters()
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        served = []
        for output in outputs:
            record = output.spec_record
            if record is None:
                record = (None, None) if self.speculative_config else ([], [])
            served.append(Served(output.token_ids, *record))
        return served, self.counters() - before, seconds

    def score(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *,
              extend: int) -> list[Scored]:
        """The target's argmax and logits at every position of each ``outputs[i]`` after
        ``prompts[i]``, and its next ``extend`` greedy tokens, in one prefill of the whole text per
        prompt (vLLM's prompt logits: the engine needs ``logprobs_mode="raw_logits"``)."""
        if self.settings.get("logprobs_mode") != "raw_logits":
            raise EvaluationError("the engine returns log-probabilities, not the logits the lossless check compares",
                                  where="VllmServer", fix='start the engine with logprobs_mode="raw_logits"')
        params = dict(temperature=0.0, max_tokens=extend, ignore_eos=True, prompt_logprobs=1, detokenize=False)
        texts = [[int(t) for t in (*p, *o)] for p, o in zip(prompts, outputs, strict=True)]
        results = self.llm.generate(texts, params)
        scored = []
        for prompt, output, result in zip(prompts, outputs, results):
            best, best_logit, token_logit = [], [], []
            for position, token in enumerate(output, start=len(prompt)):
                entry = result.prompt_logprobs[position]  # {token id: (logit, rank)}, the text's token too
                top = int(token) if entry[int(token)][1] == 1 else next(t for t, (_, rank) in entry.items() if rank == 1)
                best.append(int(top))
                best_logit.append(entry[top][0])
                token_logit.append(entry[int(token)][0])
            scored.append(Scored(best, best_logit, token_logit, result.token_ids))
        return scored

    def close(self) -> None:
        self.llm = None
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_version() -> str | None:
    from draftsmith.targets.vllm_support import installed_vllm_version

    return installed_vllm_version()
