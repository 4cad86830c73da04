"""The target answering the turns of conversations, with transformers' ``generate``
(``Regenerator``) or vLLM's engine (``VllmRegenerator``), both opened on one loaded target by
``open_regenerators``; and the judgement of what it wrote (``check_answers``: too many empty answers
stop the stage naming the target). Regeneration and synthesis answer through it."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.conversations import answer_turns, uses_tools
from draftsmith.engines.hf_model import (
    load_target_model,
    resolve_device,
    stage_model_dtype,
    stop_ids_from_files,
    stop_token_ids,
)
from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import TargetError, out_of_memory_as
from draftsmith.regenerate.settings import RegenerateSettings

log = logging.getLogger(__name__)

MAX_CHARACTER_BYTES = 4  # UTF-8's longest character
# Once this many answers are written, a target that left more than half of them empty stops the stage
# there, rather than after every chunk (hours, for a large target and data set).
EARLY_JUDGE_ANSWERS = 256


@dataclass
class TurnCounts:
    """What a chunk's regeneration produced, for the log."""

    turns: int = 0
    tokens: int = 0
    truncated: int = 0  # answers cut at max_new_tokens
    empty: int = 0  # answers that are empty or whitespace (prepare_dataset drops their conversations)
    unchanged: int = 0  # conversations passed through (template failure, tool use)
    unanswered: int = 0  # turns not answered: the conversation before them fills the engine's context
    # The first empty answer, for the message that reports them: its tokens and text, and where
    # regenerate() met it (the message's index, and the conversation's id, file and line when named).
    first_empty: dict | None = None

    def add(self, other: TurnCounts) -> None:
        for key, value in asdict(other).items():
            if key == "first_empty":
                self.first_empty = self.first_empty or value
            else:
                setattr(self, key, getattr(self, key) + value)


class Regenerator:
    """Answers the assistant turns of conversations with one loaded model and tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, settings: RegenerateSettings, *,
                 stop_ids: Sequence[int] | None = None) -> None:
        self.model, self.tokenizer, self.settings, self.seed = model, tokenizer, settings, settings.seed
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.stop_ids[0])
        self.device = next(model.parameters()).device
        self.on_answers: Callable[[int], Any] | None = None  # called with each batch's answer count

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far, rendered with the chat template (and the row's tools, as
        prepare_dataset renders them) and ending in the generation prompt, tokenized as prepare_dataset
        tokenizes held-out prompts (no extra special tokens)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int] | None]:
        """New tokens per prompt (the stop token excluded), in ``prompts`` order (None for a prompt
        that leaves no room in the engine's context: vLLM's); left-padded batches of similar length
        keep padding small."""
        s = self.settings
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b, start in enumerate(range(0, len(order), s.batch_size)):
            batch = order[start:start + s.batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            # top_k=0: generate fills in a top-k of 50 where the config leaves it unset; vLLM has none
            sampling = {} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p, "top_k": 0}
            if not s.greedy:
                # One seed per batch, derived from the chunk's and the round's, so a resumed run
                # draws what an uninterrupted run would have drawn.
                torch.manual_seed(derived_seed(seed, b))
            with torch.no_grad(), out_of_memory_as(
                    TargetError, "generating answers", where=f"a batch of {len(batch)} prompts of up to {width} tokens",
                    fix="lower regenerate.batch_size (or regenerate.max_new_tokens), or use regenerate.backend: vllm"):
                generated = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=s.max_new_tokens, do_sample=not s.greedy, **sampling,
                    eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
            for row, i in enumerate(batch):
                tokens = generated[row, width:].tolist()
                out[i] = tokens
            if self.on_answers is not None:
                self.on_answers(len(batch))
        return out

    def answer(self, tokens: list[int], counts: TurnCounts) -> str:
        """The text of one answer's new tokens, up to the first stop token (what follows it is padding)."""
        stop = next((j for j, t in enumerate(tokens) if t in self.stop_ids), None)
        counts.turns += 1
        counts.truncated += stop is None
        # Special tokens the target wrote inside its answer (tool-call or thinking markers) are part
        # of what the draft must learn: kept, so the text re-encodes to the target's ids.
        tokens = tokens[:stop]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        if stop is None:
            # A character max_new_tokens cut in half decodes to U+FFFD, which re-encodes to other ids
            # than the target wrote: its byte tokens (all but one of a character's at most) are left out.
            for _ in range(MAX_CHARACTER_BYTES - 1):
                if not text.endswith("\ufffd"):
                    break
                tokens = tokens[:-1]
                text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        counts.tokens += len(tokens)
        if not text.strip():
            counts.empty += 1
            if counts.first_empty is None:
                counts.first_empty = {"tokens": list(tokens), "text": text}
        return text

    def regenerate(self, conversations: list[list[dict]], seed: int = 0,
                   tools: Sequence[list[dict] | None] | None = None,
                   names: Sequence[dict] | None = None) -> tuple[list[list[dict]], TurnCounts]:
        """The conversations with every answer (``answer_turns``) replaced by the model's, in order (an
        empty one is written: a turn left for the target to answer); ``tools``: each conversation's tool
        definitions (or None), given to the chat template; ``names``: each conversation's ``id``,
        ``file`` and ``line``, for the message about empty answers. Assistant turns that open a
        conversation before any user turn answer nothing: they stay as written, as context of the
        answers after them.

        A conversation the chat template cannot render is returned unchanged: prepare_dataset drops
        and counts it with its reason. So is one with tool calls or tool results (``uses_tools``): the
        tools cannot be run here to answer the target's own calls. A turn whose prompt leaves no
        room in the engine's context is not answered, nor any turn after it (counted in
        ``unanswered``): none of it could be trained. A conversation with answers before such a turn
        ends after the last of them (an empty answer, or a placeholder left empty, would make
        prepare_dataset drop the answers before it too); one without stays as written.
        """
        messages = [[dict(m) for m in conv] for conv in conversations]
        tools = list(tools) if tools is not None else [None] * len(conversations)
        turns = [answer_turns(conv) for conv in messages]
        skipped: set[int] = {c for c, conv in enumerate(messages) if uses_tools(conv)}
        counts = TurnCounts()
        for r in range(max(map(len, turns), default=0)):
            jobs, prompts = [], []
            for c, t in enumerate(turns):
                if len(t) <= r or c in skipped:
                    continue
                try:
                    prompts.append(self.prompt_ids(messages[c][:t[r]], tools[c]))
                except Exception as e:  # noqa: BLE001 - Jinja templates raise anything; see docstring
                    log.debug("conversation %d: the chat template failed (%s); left unchanged", c, e)
                    skipped.add(c)
                    continue
                jobs.append((c, t[r]))
            answers = self.generate(prompts, seed=derived_seed(self.seed, seed, r))
            for (c, k), tokens in zip(jobs, answers):
                if tokens is None:  # no room left: nothing from this turn on is answered
                    counts.unanswered += len(turns[c]) - r
                    turns[c] = turns[c][:r]
                    if r:
                        del messages[c][turns[c][-1] + 1:]
                    continue
                messages[c][k] = {"role": "assistant", "content": self.answer(tokens, counts)}
                if counts.first_empty is not None and "message" not in counts.first_empty:
                    counts.first_empty.update(message=k, **(names[c] if names is not None else {}))
        for c in skipped:
            messages[c] = [dict(m) for m in conversations[c]]
        counts.unchanged += len(skipped)
        return messages, counts


class VllmRegenerator(Regenerator):
    """A ``Regenerator`` whose rounds run in vLLM's engine (``VllmGenerator``): one call per round,
    vLLM batching the prompts itself (up to ``batch_size`` sequences at once, its max_num_seqs)."""

    def __init__(self, generator: Any, tokenizer: Any, settings: RegenerateSettings, *, stop_ids: Sequence[int]) -> None:
        self.generator, self.tokenizer, self.settings, self.seed = generator, tokenizer, settings, settings.seed
        self.stop_ids = list(stop_ids)
        self.on_answers = None

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        s = self.settings
        # One seed per request (vLLM samples each request from its own generator), derived from the
        # chunk's and the round's, so a resumed run draws what an uninterrupted run would have drawn.
        out = self.generator.generate(prompts, max_new_tokens=s.max_new_tokens, stop_ids=self.stop_ids,
                                      temperature=s.temperature, top_p=s.top_p,
                                      seeds=[derived_seed(seed, n) for n in range(len(prompts))])
        if self.on_answers is not None:
            self.on_answers(len(prompts))
        return out


def derived_seed(*parts: int) -> int:
    """A seed for one batch of one round of one chunk, independent of what ran before it."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:7], "big")


@contextmanager
def open_regenerators(model_path: str | Path, tokenizer: Any, settings: Sequence[RegenerateSettings], *,
                      trust_remote_code: bool = False, engine_kwargs: dict | None = None,
                      stop_ids: Sequence[Sequence[int] | None] = (), shared_engine: SharedEngine | None = None
                      ) -> Iterator[list[Regenerator]]:
    """The target in ``model_path`` loaded once (transformers or vLLM, per ``settings[0].backend``),
    and one Regenerator on it per entry of ``settings``, each with its own sampling and lengths;
    ``stop_ids[i]``, where given, adds stop tokens to the i-th (a user turn's end, say).
    ``engine_kwargs`` are vLLM's; ``shared_engine`` as ``regenerate_responses`` says."""
    first = settings[0]
    torch_device = resolve_device(first.device)
    dtype_name = stage_model_dtype(first)
    sampling = ("greedy" if first.greedy else f"temperature {first.temperature}, top_p {first.top_p}, seed {first.seed}")
    extra = list(stop_ids) + [None] * (len(settings) - len(stop_ids))
    if first.backend != "vllm":
        model = load_target_model(model_path, dtype=dtype_name, device=first.device,
                                  trust_remote_code=trust_remote_code)
        log.info("generating with %s on %s (%s): %s", model_path, torch_device, dtype_name, sampling)
        defaults = stop_token_ids(model, tokenizer)
        yield [Regenerator(model, tokenizer, s, stop_ids=[*defaults, *(more or ())]) for s, more in zip(settings, extra)]
        return

    from draftsmith.engines.vllm_generation import VllmGenerator

    defaults = stop_ids_from_files(model_path, trust_remote_code=trust_remote_code)
    if shared_engine is not None:
        generator = VllmGenerator(str(model_path), slot_engine=shared_engine.slot_engine(str(model_path), **{
            **(engine_kwargs or {}), "tensor_parallel_size": first.tensor_parallel_size, "dtype": dtype_name,
            "trust_remote_code": trust_remote_code}))
        log.info("regeneration decodes in the engine capture and evaluation share (eager, with a speculator slot "
                 "of k=%d; regenerate.batch_size does not apply): the run loads the target once",
                 shared_engine.speculative_tokens)
    else:
        generator = VllmGenerator(str(model_path), tensor_parallel_size=first.tensor_parallel_size, dtype=dtype_name,
                                  trust_remote_code=trust_remote_code, max_num_seqs=first.batch_size,
                                  enforce_eager=first.enforce_eager, **(engine_kwargs or {}))
    with generator:
        log.info("generating with %s in vLLM, tensor parallel %d (%s): %s", model_path,
                 first.tensor_parallel_size, dtype_name, sampling)
        yield [VllmRegenerator(generator, tokenizer, s, stop_ids=[*defaults, *(more or ())])
               for s, more in zip(settings, extra)]


def mostly_empty_so_far(counts: TurnCounts) -> bool:
    """Enough answers written to judge them before the last chunk, and more than half of them empty."""
    return counts.turns >= EARLY_JUDGE_ANSWERS and counts.empty > counts.turns / 2


def check_answers(counts: TurnCounts, settings: RegenerateSettings, tokenizer: Any, target: str | Path) -> None:
    """Judge the answers the target wrote (with ``settings``): more than data.max_bad_fraction of
    them empty (nothing but whitespace) raise ``TargetError`` naming the target; fewer, if any, are a
    warning."""
    if not counts.empty:
        return
    share = counts.empty / counts.turns
    said = f"the target wrote {counts.empty} empty answers of {counts.turns} ({100 * share:.1f}%)"
    first = f"; the first: {_describe_empty(counts.first_empty, tokenizer)}" if counts.first_empty else ""
    if share <= settings.max_bad_fraction:
        log.warning("%s; prepare_dataset drops their conversations%s", said, first)
        return
    raise TargetError(
        f"{said}, more than data.max_bad_fraction={settings.max_bad_fraction}: prepare_dataset would drop their "
        f"conversations as empty turns{first}",
        where=f"the target {target}, regenerating with regenerate.backend={settings.backend}, "
              f"regenerate.temperature={settings.temperature}, regenerate.top_p={settings.top_p}, "
              f"regenerate.max_new_tokens={settings.max_new_tokens}",
        fix="check that the target's weights and tokenizer belong together (a model whose vocabulary is larger than "
            "its tokenizer's writes ids that decode to nothing), that its chat template is the one it was trained "
            "with, and the sampling settings regenerate.temperature, regenerate.top_p and "
            "regenerate.max_new_tokens; then rerun (every answer is regenerated)")


def _describe_empty(first: dict, tokenizer: Any) -> str:
    """Where the first empty answer was, its tokens, and why they decode to nothing."""
    tokens, text = first["tokens"], first["text"]
    where = f"conversation {first['id']!r} ({first['file']}:{first['line']}), message {first['message']}" \
        if "id" in first else "one answer"
    if not tokens:
        return f"{where}: no tokens (the target stopped at once)"
    unknown = sum(tokenizer.convert_ids_to_tokens(int(t)) is None for t in tokens)
    shown = f"{tokens[:8]}"[:-1] + (", ...]" if len(tokens) > 8 else "]")
    why = (f"{unknown} of them outside the tokenizer's {len(tokenizer)} ids" if unknown
           else "only whitespace")
    return f"{where}: {len(tokens)} token{'s' * (len(tokens) != 1)} {shown} ({why}) decoded to {text!r}"
