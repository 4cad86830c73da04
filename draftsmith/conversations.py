"""Conversations: every row of the data sources (``draftsmith.sources`` reads them) normalized to
OpenAI-style messages (system, user, assistant with optional tool calls, tool results; plus the
row's tool definitions) or plain text, or reported as a ``BadRow`` with its reason
(``draftsmith.bad_rows``); and the one rule of which turns are answers.

This is all that regeneration needs of the data; tokenising and masking live in
``draftsmith.data`` (prepare_dataset), so a change there does not discard regenerated answers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.bad_rows import BadRow, row_where
from draftsmith.errors import DataError
from draftsmith.sources import MIN_MAX_LINE_BYTES, RawRow, parse_row, read_rows

FORMATS = ("auto", "messages", "conversations", "text")


ROLES = {
    # OpenAI (function: the legacy name of tool results)
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool",
    # ShareGPT (observation: tool results in glaive-style function-calling sets)
    "human": "user", "gpt": "assistant", "observation": "tool",
    # Llama 3.1 names tool results ipython
    "ipython": "tool",
}

# Fields a prompt-only row (eval.sources) may hold its prompt in, in the order they are looked
# for: MT-bench (turns), HumanEval (prompt), GSM8K (question), Alpaca (instruction), plain text.
PROMPT_FIELDS = ("turns", "prompt", "question", "instruction", "text")
# What completes an instruction in the same user turn: Alpaca's input, Dolly's context.
INPUT_FIELDS = ("input", "context")
ID_FIELDS = ("id", "question_id", "task_id")


@dataclass(frozen=True)
class Conversation:
    """A usable row: ``messages`` (OpenAI-style [{role, content, ...}], roles system/user/assistant/
    tool, ending with an assistant turn; an assistant turn may carry ``tool_calls``, a tool turn
    ``tool_call_id``/``name``; read for regeneration, an assistant turn may be empty: the target
    writes it) and ``tools`` (the row's tool definitions, or None) for chat rows, or
    ``text`` for plain-text rows. ``id`` is the row's own id, not yet made unique across sources."""

    id: str
    file: str
    line: int
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    tools: list[dict] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def where(self) -> str:
        return row_where(self.file, self.line)


Row = Conversation | BadRow


def answer_turns(messages: list[dict[str, Any]]) -> list[int]:
    """The indexes of a conversation's answers: its assistant turns that follow a user or tool turn.
    The one rule of what the loss, regeneration and prompts count as an answer: assistant turns
    before any user turn (a bot's greeting that opens the chat, common in ShareGPT dumps) answer
    nothing, so they stay in the rendered text, and in the first answer's prompt, as context only."""
    asked = False
    answers = []
    for k, message in enumerate(messages):
        asked = asked or message["role"] in ("user", "tool")
        if asked and message["role"] == "assistant":
            answers.append(k)
    return answers


def first_answer(messages: list[dict[str, Any]]) -> int:
    """The index of a conversation's first answer (``answer_turns``): the turns before it are its
    prompt; ``len(messages)`` for a conversation without one (an evaluation prompt)."""
    return next(iter(answer_turns(messages)), len(messages))


def load_conversations(sources: Sequence[str | Path], format: str = "auto",
                       max_line: int = MIN_MAX_LINE_BYTES, regenerating: bool = False) -> Iterator[Row]:
    """Yield every row of ``sources`` in order, normalized to a ``Conversation`` or a ``BadRow``;
    ``regenerating``: as regeneration reads them (``to_row``).

    A missing or unreadable source, or one without any row, raises ``DataError``; a jsonl line
    over ``max_line`` bytes is a bad row, skipped without being loaded.
    """
    check_format(format)
    for raw in read_rows(sources, max_line):
        yield to_row(raw, format, regenerating)


def check_format(format: str) -> None:
    """Raise ``DataError`` unless ``format`` is one of ``FORMATS``."""
    if format not in FORMATS:
        raise DataError(f"unknown data format {format!r}", where="config key data.format",
                        fix="use one of " + ", ".join(FORMATS))


def to_row(raw_row: RawRow, format: str = "auto", regenerating: bool = False) -> Row:
    """A row of ``read_rows`` parsed and normalized to a ``Conversation`` or a ``BadRow``.
    ``regenerating``: read as regeneration reads it, the target writing the answers: an empty
    assistant turn is one to write, and a conversation that ends with a user turn (a prompt alone,
    say) gets an empty assistant turn after it; not in a conversation that uses tools, which
    regeneration leaves as it is (``uses_tools``)."""
    file, line, raw = raw_row
    raw = parse_row(file, line, raw)
    return raw if isinstance(raw, BadRow) else _normalize(raw, file, line, format,
                                                          "written" if regenerating else "given")


def load_prompts(sources: Sequence[str | Path], max_line: int = MIN_MAX_LINE_BYTES) -> Iterator[Row]:
    """Yield every row of evaluation prompt sets (eval.sources) as a ``Conversation`` whose messages
    are the prompt (the turns before the first answer; an answer is not needed), or a ``BadRow``.

    Besides conversations, a row may hold its prompt in one of ``PROMPT_FIELDS``, which becomes a
    user turn (an instruction with its ``INPUT_FIELDS`` text); its id may be in one of ``ID_FIELDS``.
    A row's ``system`` field becomes a system turn.
    """
    for source, line, raw in _rows(sources, max_line, "eval.sources"):
        if isinstance(raw, BadRow):
            yield raw
            continue
        if isinstance(raw, dict) and raw.get("messages") is None and raw.get("conversations") is None:
            field = next((f for f in PROMPT_FIELDS if raw.get(f) is not None), None)
            if field is None:
                keys = ", ".join(sorted(map(str, raw))) or "none"
                yield BadRow(source, line, "unknown_format", f"no 'messages', 'conversations' or prompt field "
                                                             f"({', '.join(PROMPT_FIELDS)}) (keys: {keys})")
                continue
            value = raw[field]
            if field == "turns" and isinstance(value, list) and value and not _is_turn_list(value):
                value = value[0]  # MT-bench's strings: later turns follow the target's own first answer
            if field == "instruction":
                value = _with_input(value, raw)
            row_id = next((raw[f] for f in ID_FIELDS if raw.get(f) not in (None, "")), None)
            # TRL's conversational prompt-only rows hold the prompt's turns under "prompt" (OpenAI's
            # or ShareGPT's keys, read as in a conversation)
            turns = value if _is_turn_list(value) else [{"role": "user", "content": value}]
            raw = {"id": row_id, "system": raw.get("system"), "messages": turns}
        row = _normalize(_with_system_turn(raw), source, line, "auto", "optional")
        if isinstance(row, Conversation):
            first = first_answer(row.messages)
            if not any(m["role"] in ("user", "tool") for m in row.messages[:first]):
                row = BadRow(source, line, "missing_turns", "no user turn to answer: roles "
                                                            + ", ".join(m["role"] for m in row.messages))
            else:
                row = dataclasses.replace(row, messages=row.messages[:first])
        yield row


def _is_turn_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and ("role" in v or "from" in v)
                                                           for v in value)


def _with_input(instruction: Any, raw: dict) -> Any:
    """An instruction followed by its input (Alpaca's ``input``, Dolly's ``context``) after a blank
    line, as Alpaca's own prompt lays them out; without one, the instruction alone: the task is
    often unanswerable without the text it is about."""
    extra = next((raw[f] for f in INPUT_FIELDS if isinstance(raw.get(f), str) and raw[f].strip()), None)
    if extra is None or not isinstance(instruction, str):
        return instruction
    return f"{instruction}\n\n{extra}"


def _with_system_turn(raw: Any) -> Any:
    """A row whose ``system`` field holds its system prompt (instruction sets, ShareGPT exports),
    with that prompt as a first system turn, which the chat template renders; a row whose turns
    already open with a system turn as it is."""
    system = raw.get("system") if isinstance(raw, dict) else None
    key = next((k for k in ("messages", "conversations") if isinstance(raw, dict) and raw.get(k) is not None), None)
    if not isinstance(system, str) or not system.strip() or key is None or not isinstance(raw[key], list):
        return raw
    first = raw[key][0] if raw[key] else None
    role = first.get("role", first.get("from")) if isinstance(first, dict) else None
    if isinstance(role, str) and ROLES.get(role) == "system":
        return raw
    return {**raw, key: [{"role": "system", "content": system}, *raw[key]]}


def _rows(sources: Sequence[str | Path], max_line: int, key: str) -> Iterator[tuple[str, int, Any]]:
    """(source, line, parsed row or BadRow) for every row of ``sources``; a source without rows raises."""
    for file, line, raw in read_rows(sources, max_line, key):
        yield file, line, parse_row(file, line, raw)


def line_id(file: str, line: int) -> str:
    """The id of a row that has none: its file's stem and line. Two sources of one name (a/train.jsonl,
    b/train.jsonl) give the same ids; ``prepare_dataset`` makes them unique without counting them
    under ``duplicate_ids``, which counts the ids rows carry more than once."""
    return f"{Path(file).stem}:{line}"


def _normalize(raw: Any, file: str, line: int, fmt: str, answers: str = "given") -> Row:
    """``raw`` as a ``Conversation`` or a ``BadRow``. ``answers``: "given" (rows trained on as they
    are: at least one answer, none empty), "optional" (evaluation prompts: the turns as they are) or
    "written" (the target writes them: see ``to_row``)."""

    def bad(reason: str, detail: str) -> BadRow:
        return BadRow(file, line, reason, detail)

    if not isinstance(raw, dict):
        return bad("unknown_format", f"a row must be an object, not a {type(raw).__name__}")
    raw_id = raw.get("id")
    row_id = str(raw_id) if raw_id not in (None, "") else line_id(file, line)

    if fmt == "auto":
        # A key holding null counts as absent: parquet and datasets fill columns a row lacks with null.
        fmt = next((k for k in ("messages", "conversations", "text") if raw.get(k) is not None), "")
        if not fmt:
            keys = ", ".join(sorted(map(str, raw))) or "none"
            return bad("unknown_format", f"no 'messages', 'conversations' or 'text' field (keys: {keys})")
    value = raw.get(fmt)
    if value is None:
        return bad("missing_turns", f"no '{fmt}' field")

    if fmt == "text":
        if not isinstance(value, str):
            return bad("non_text_content", f"'text' is a {type(value).__name__}, not a string")
        if not value.strip():
            return bad("empty_turn", "'text' is empty")
        if surrogate := _lone_surrogate(value):
            return bad("invalid_unicode", surrogate)
        return Conversation(row_id, file, line, text=value)

    # OpenAI rows use role/content, ShareGPT rows from/value; accept either in both, since
    # many published datasets mix the two spellings.
    keys = (("role", "content"), ("from", "value"))
    if fmt == "conversations":
        keys = keys[::-1]
    if not isinstance(value, list) or not value:
        return bad("missing_turns", f"'{fmt}' is {'empty' if value == [] else 'not a list'}")
    tools = _parse_json_field(raw.get("tools"))
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return bad("invalid_tool_call", "'tools' is not a list of tool definitions (objects)")
    messages: list[dict[str, Any]] = []
    for k, turn in enumerate(value):
        if not isinstance(turn, dict):
            return bad("unknown_format", f"turn {k} is a {type(turn).__name__}, not an object")
        role_key, content_key = next(((r, c) for r, c in keys if r in turn), keys[0])
        role = ROLES.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
        if role is None:
            return bad("unknown_role", f"turn {k} has {role_key}={turn.get(role_key)!r}")
        message: dict[str, Any] = {"role": role}
        calls = _tool_calls(turn.get("tool_calls")) if role == "assistant" else None
        if isinstance(calls, str):
            return bad("invalid_tool_call", f"turn {k} (assistant): {calls}")
        content = _content_text(turn.get(content_key))
        # A turn of tool calls only (OpenAI writes content: null), a silent tool, an answer the target writes
        may_be_empty = calls or role == "tool" or (role == "assistant" and answers == "written")
        if may_be_empty and content == ("empty_turn", "content is null"):
            content = ""
        if isinstance(content, tuple):
            return bad(content[0], f"turn {k} ({role}): {content[1]}")
        if not content.strip() and not may_be_empty:
            return bad("empty_turn", f"turn {k} ({role}) is empty")
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(turn.get(key), str):
                    message[key] = turn[key]
        messages.append(message)

    if answers == "written" and uses_tools(messages):
        return _normalize(raw, file, line, fmt, "given")  # regeneration passes it through: trained on as it is
    if answers == "written" and messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})  # the target answers the last prompt
    answer_ids = answer_turns(messages)
    if not answer_ids and answers != "optional":
        roles = ", ".join(m["role"] for m in messages)
        if any(m["role"] == "assistant" for m in messages):
            return bad("no_assistant_turn", f"no assistant turn follows a user or tool turn (roles: {roles}): an "
                                            "assistant turn that opens the conversation is context, not an answer")
        return bad("no_assistant_turn", f"roles: {roles}")
    # Turns after the last answer carry no loss and precede nothing: they would cost tokens only.
    # A prompt (no answer required) keeps them all.
    end = len(messages) if answers == "optional" else answer_ids[-1] + 1
    surrogate = _lone_surrogate([messages[:end], tools])
    if surrogate:
        return bad("invalid_unicode", surrogate)
    try:  # parquet and datasets can hold values JSON has no form for (bytes, timestamps) in tools or calls
        json.dumps([messages, tools])
    except (TypeError, ValueError) as e:
        return bad("invalid_tool_call", f"a tool definition or call holds a value that is not JSON: {e}")
    return Conversation(row_id, file, line, messages=messages[:end], tools=tools or None)


def uses_tools(messages: list[dict]) -> bool:
    """Whether a conversation holds tool calls or tool results: regeneration cannot run the tools to
    answer the target's own calls, so it leaves such a conversation as it is."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _parse_json_field(value: Any) -> Any:
    """A field that datasets often store as a JSON string (tools, tool call arguments), parsed;
    the value itself when it is not a string or not JSON."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _tool_calls(calls: Any) -> list[dict] | str | None:
    """An assistant turn's tool calls in OpenAI's shape, ``{"type": "function", "function":
    {"name", "arguments"}}`` with the arguments as an object (as chat templates expect them), or a
    string saying why they are unusable."""
    calls = _parse_json_field(calls)
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        return f"tool_calls is a {type(calls).__name__}, not a list"
    out = []
    for n, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return f"tool call {n} has no function name"
        arguments = _parse_json_field(function.get("arguments", {}))
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return f"tool call {n} ({function['name']}): arguments are not a JSON object"
        normalized = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            normalized["id"] = call["id"]
        out.append(normalized)
    return out


def _lone_surrogate(value: Any) -> str | None:
    """Where ``value`` holds a string that is not valid Unicode (a lone surrogate such as "\\ud800",
    which JSON allows and no tokenizer takes), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"a lone surrogate {value[e.start]!r} at character {e.start}"
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for item in items if (found := _lone_surrogate(item))), None)


def _content_text(content: Any) -> str | tuple[str, str]:
    """The text of a message's content, or (reason, detail) when it has none usable."""
    if content is None:
        return "empty_turn", "content is null"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                return "non_text_content", f"a content part of type {kind!r}"
            texts.append(part["text"])
        # Joined without a separator, as chat templates that accept parts render them.
        return "".join(texts)
    return "non_text_content", f"content is a {type(content).__name__}"
