"""The chat template and the loss mask: conversations rendered by the target's tokenizer, with 1 on
exactly the tokens each assistant turn wrote."""

from __future__ import annotations

import importlib
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from draftsmith.conversations import answer_turns, first_answer
from draftsmith.errors import DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(DataError):
    """The chat template cannot render a conversation, or its assistant tokens cannot be located."""


class TokenizerFailure(DataError):
    """The tokenizer raised on a row's text: the row is bad, not the stage."""


def encode_text(tokenizer, text: str, **kwargs):
    """``tokenizer(text, **kwargs)``, with whatever the tokenizer raises as a TokenizerFailure."""
    try:
        return tokenizer(text, **kwargs)
    except Exception as e:  # Rust tokenizers raise TypeError, ValueError, pyo3 panics, ...
        raise TokenizerFailure(f"the tokenizer failed: {type(e).__name__}: {e}") from e


def load_tokenizer(tokenizer_dir: str | Path, tokenizer_class: str | None = None):
    """The target's fast tokenizer; character offsets (for the loss mask) need a fast one.
    ``tokenizer_class``: the dotted class AutoTokenizer picks for this folder (target.json's
    ``tokenizer_class``), loaded directly; None, or a class of the model's own code, goes through
    AutoTokenizer."""
    try:
        tokenizer = _tokenizer_loader(tokenizer_class).from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"cannot load a tokenizer from {tokenizer_dir}: {e}", where=str(tokenizer_dir),
                        fix="point at the target model folder; it must hold tokenizer.json and "
                            "tokenizer_config.json") from e
    if not tokenizer.is_fast:
        raise DataError(f"the tokenizer in {tokenizer_dir} is a slow (Python) tokenizer",
                        where=str(tokenizer_dir),
                        fix="add tokenizer.json (save the tokenizer once with AutoTokenizer(..., "
                            "use_fast=True).save_pretrained) so character offsets are available")
    return tokenizer


def _tokenizer_loader(tokenizer_class: str | None):
    # Importing AutoTokenizer imports torch and transformers' generation code (seconds); the class it
    # picks does not. A model's own code lives in transformers_modules, which only AutoTokenizer imports.
    if tokenizer_class is not None and tokenizer_class.startswith("transformers."):
        module, _, name = tokenizer_class.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            pass  # a transformers release without that class: AutoTokenizer picks again
    from transformers import AutoTokenizer

    return AutoTokenizer


def require_chat_template(tokenizer, tokenizer_dir: str | Path) -> None:
    if not tokenizer.chat_template:
        raise DataError(f"the tokenizer in {tokenizer_dir} has no chat template, so conversations "
                        "cannot be rendered", where=str(tokenizer_dir),
                        fix="use the tokenizer of an instruct/chat model, or add a chat_template.jinja to "
                            "the folder (evaluation decodes chat prompts, so plain text alone cannot do)")


def added_special_tokens(tokenizer) -> dict[int, str]:
    """The tokenizer's added special tokens, id to text: the chat template's markers among them,
    whether or not the special tokens map names them (it may name another eos than a turn's end)."""
    return {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and finds the assistant's tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(added_special_tokens(tokenizer).values())
        special |= {t for t in (tokenizer.eos_token,) if t}
        self.special = re.compile("|".join(map(re.escape, sorted(special, key=len, reverse=True)))) \
            if special else None
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.has_generation_tags = bool(_GENERATION_TAG.search(template))

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # Jinja templates raise anything (raise_exception, TypeError, ...)
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    def encode(self, text: str, offsets: bool = False):
        return encode_text(self.tokenizer, text, add_special_tokens=False, return_offsets_mapping=offsets)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the turns before the first answer (``answer_turns``: an assistant turn that
        opens the conversation is part of the prompt; all the turns of a conversation without an
        answer: an evaluation prompt), ending in the generation prompt."""
        first = first_answer(messages)
        return list(self.encode(self.render(messages[:first], True, tools))["input_ids"])

    def tokenize(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        try:
            full = self.render(messages, add_generation_prompt=False, tools=tools)
        except ChatTemplateError as e:
            if not self._refuses_opening(messages, tools):
                raise
            raise ChatTemplateError(
                f"the chat template refuses a conversation that opens with an assistant turn ({e.what}); "
                "it renders the same conversation without that turn",
                fix="drop the assistant turns before the first user turn from these rows (they are context, "
                    "never trained on), remove the rows, or use a chat template that renders them") from e
        spans = self._assistant_spans(messages, full, tools)
        if spans is None:
            return self._generation_tag_mask(messages, tools)
        enc = self.encode(full, offsets=True)
        marked = [0] * (len(full) + 1)  # marked[c] = 1 when character c is the assistant's
        for start, end in spans:
            marked[start:end] = [1] * (end - start)
        covered = list(itertools.accumulate(marked, initial=0))  # covered[c] = sum(marked[:c])
        mask = []
        for s, e in enc["offset_mapping"]:
            # A token straddling a span's edge (possible with some merges) counts as the assistant's.
            mask.append(1 if (covered[e] - covered[s] if e > s else marked[s]) else 0)
        return list(enc["input_ids"]), mask

    def _refuses_opening(self, messages: list[dict], tools: list[dict] | None) -> bool:
        """Whether the chat template, which cannot render ``messages``, refuses them for the assistant
        turns that open them (templates that enforce user/assistant alternation raise on those):
        it renders the conversation without them."""
        answers = answer_turns(messages)
        opening = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k not in answers]
        if not opening:
            return False
        try:
            self.render([m for k, m in enumerate(messages) if k not in opening], False, tools)
        except ChatTemplateError:
            return False
        return True

    def _assistant_spans(self, messages: list[dict], full: str,
                         tools: list[dict] | None = None) -> list[tuple[int, int]] | None:
        """Character spans of each answer's text (and tool calls) plus the token that closes its
        turn, or None when a prefix of the conversation does not render as a prefix of the whole.
        Assistant turns before any user turn get none: they answer nothing (``answer_turns``)."""
        spans = []
        for k in answer_turns(messages):
            message = messages[k]
            before = self.render(messages[:k], add_generation_prompt=True, tools=tools)
            through = self.render(messages[: k + 1], add_generation_prompt=False, tools=tools)
            if not full.startswith(before):
                return None
            # Some templates close the last message differently (e.g. append an EOS): the turn
            # ends where the rendering up to it stops agreeing with the whole.
            end = len(os.path.commonprefix([through, full]))
            turn = full[len(before):end]
            content = message["content"]
            found = turn.find(content)
            if found < 0 and content.strip():
                content = content.strip()  # templates that trim content (Llama 3)
                found = turn.find(content)
            if found < 0:
                return None  # the template rewrote this turn
            cut = found + len(content)
            if message.get("tool_calls"):
                # The calls follow the text in the template's own syntax (<tool_call>{json}</tool_call>,
                # a bare JSON object, ...): the assistant wrote all of the turn up to and including
                # its closing special token.
                missing = [c["function"]["name"] for c in message["tool_calls"]
                           if c["function"]["name"] not in turn[cut:]]
                if missing:
                    raise ChatTemplateError(
                        f"the chat template does not render the assistant's tool calls ({', '.join(missing)} "
                        "is missing from the rendered turn)",
                        fix="use the target's tool-use chat template (one that renders message.tool_calls), "
                            "or drop the tool-call rows")
                closes = list(self.special.finditer(turn, cut)) if self.special else []
                spans.append((len(before) + found, len(before) + (closes[-1].end() if closes else len(turn))))
                continue
            spans.append((len(before), len(before) + cut))
            # The turn's end-of-turn token (<|im_end|>, <|eot_id|>, </s>): the assistant emits it.
            close = self.special.search(turn, cut) if self.special else None
            if close:
                spans.append((len(before) + close.start(), len(before) + close.end()))
        return spans

    def _generation_tag_mask(self, messages: list[dict],
                             tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        if not self.has_generation_tags:
            raise ChatTemplateError(
                "the chat template rewrites earlier turns (rendering the turns before an assistant "
                "turn is not a prefix of rendering the whole conversation), so the assistant's "
                "tokens cannot be located, and it has no {% generation %} markers to say where they are",
                fix="wrap assistant content (and the end-of-turn token) in {% generation %}..."
                    "{% endgeneration %} in the chat template, or use a template that renders a "
                    "conversation prefix by prefix")
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        except Exception as e:  # as in render(): a template can raise anything
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        mask = list(out["assistant_masks"])
        answers = answer_turns(messages)
        opening = sum(m["role"] == "assistant" for m in messages) - len(answers)
        if opening:
            # The {% generation %} blocks mark every assistant turn; those that open the conversation
            # answer nothing. Each block is one run of the mask, in the turns' order.
            runs = [k for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1])]
            if len(runs) != opening + len(answers):
                raise ChatTemplateError(
                    "the chat template's {% generation %} blocks are not one per assistant turn, so the tokens of "
                    "the assistant turn that opens the conversation (context, not an answer) cannot be told apart",
                    fix="drop the assistant turns before the first user turn from these rows, or remove the rows")
            mask[:runs[opening]] = [0] * runs[opening]
        return list(out["input_ids"]), mask


def tokenize_conversation(tokenizer, messages: list[dict],
                          tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation (with ``tools`` given to the chat template) and its
    loss mask: 1 exactly on the tokens each answer wrote (its text, its tool calls and its end-of-turn
    token); 0 on headers, system, user text, tool definitions, tool results and the assistant turns
    that open the conversation before any user turn (``answer_turns``)."""
    return ChatRenderer(tokenizer).tokenize(messages, tools)


# The user turn's opening, for conversations the target writes itself (draftsmith.synthesize): what
# the template renders before a user's text is found by rendering a placeholder, characters no
# template writes itself.
USER_TURN_PLACEHOLDER = "\u2063\u2063draftsmith-user-turn\u2063\u2063"


@dataclass(frozen=True)
class UserTurn:
    """What the chat template renders before a user's text (after ``system``), as token ids, and the
    special tokens that can close the turn."""

    system: str | None
    opening: list[int]
    closing: list[int]


def user_turn(tokenizer, system: str | None, where: str) -> UserTurn:
    """The user turn's opening and closing tokens of ``tokenizer``'s chat template, found by rendering
    a placeholder; refused when the template changes the user's text or closes the turn with no
    special token (the request could not be told from its end)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER_TURN_PLACEHOLDER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - Jinja templates raise anything
        raise DataError(f"the chat template cannot render a user turn{' after a system prompt' if system else ''}: "
                        f"{type(e).__name__}: {e}", where=where,
                        fix="remove synthesize.system_prompts if the template takes no system turn") from e
    head, found, tail = text.partition(USER_TURN_PLACEHOLDER)
    if not found:
        raise DataError("the chat template does not render the user's text as given, so where a user turn "
                        "starts cannot be found", where=where, fix="use data.sources of your own for this target")
    special = set(tokenizer.all_special_ids) | set(added_special_tokens(tokenizer))
    closing = [t for t in tokenizer(tail, add_special_tokens=False)["input_ids"] if t in special]
    if not closing:
        raise DataError("the chat template closes a user turn without a special token, so the target's request "
                        "cannot be told from its end", where=where, fix="use data.sources of your own for this target")
    # A space the template puts before the user's text belongs to its first word ("[INST] Hello"
    # tokenizes " Hello"): left out, the target writes it with the word, as in its training.
    opening = list(tokenizer(head.rstrip(" "), add_special_tokens=False)["input_ids"])
    return UserTurn(system, opening, closing[:1])
