"""A vLLM engine's calls in plain data: a job asks with token ids and its sampling settings as a dict
(``vllm.SamplingParams``' own arguments) and gets back token ids, vLLM's per-step records, prompt
logits and metrics as plain Python. vLLM's objects are made and read in the engine's process, so a
job attached to a warm engine never imports vLLM (12-15 s of every such job on a GPU machine: the
attach itself takes under a second), and a job's own engine (``ServedLLM`` around ``vllm.LLM`` in
its process) answers in the same form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draftsmith.targets.vllm_compat import spec_decode_record


@dataclass
class Generated:
    """One prompt's answer: its new tokens, vLLM's per-step record (accepted and proposed draft
    tokens per verification step; None where the release keeps none), and, when asked for, the
    prompt's log-probabilities or logits per position ({token id: (value, rank)}; None at the first)."""

    token_ids: list[int]
    spec_record: tuple[list[int], list[int]] | None
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


@dataclass
class Metric:
    """One of ``LLM.get_metrics()``: a counter's or gauge's ``value``, or a vector's ``values``."""

    name: str
    value: float | None = None
    values: list[float] | None = None


class ServedLLM:
    """``vllm.LLM`` behind the calls a warm engine serves: ``generate``, ``collective_rpc`` and
    ``get_metrics`` in plain data, ``sleep`` and ``wake_up`` as vLLM's; ``llm`` is vLLM's own."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict | Sequence[dict]) -> list[Generated]:
        """vLLM's answers to ``prompts`` (token ids) in prompt order, all in one call; ``sampling``
        holds ``SamplingParams``' arguments, for every prompt or one dict per prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(**sampling) if isinstance(sampling, dict) else [SamplingParams(**s) for s in sampling]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
                                    use_tqdm=False)
        return [_generated(output) for output in outputs]

    def collective_rpc(self, *args, **kwargs):
        return self.llm.collective_rpc(*args, **kwargs)

    def get_metrics(self) -> list[Metric]:
        return [Metric(m.name, getattr(m, "value", None), None if getattr(m, "values", None) is None else list(m.values))
                for m in self.llm.get_metrics()]

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()


def _generated(output) -> Generated:
    completion = output.outputs[0]
    logprobs = None
    if output.prompt_logprobs is not None:  # a list, or vLLM's FlatLogprobs: per position {token: Logprob}
        logprobs = [None if entry is None else {int(t): (float(v.logprob), int(v.rank)) for t, v in entry.items()}
                    for entry in output.prompt_logprobs]
    return Generated([int(t) for t in completion.token_ids], spec_decode_record(completion), logprobs)
