"""prepare_dataset: formats, bad rows, the assistant-only loss mask, truncation, held-out split, stats."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import tiny
from draftsmith.chat import ChatTemplateError, tokenize_conversation
from draftsmith.data import (
    REASONS,
    BadRow,
    Conversation,
    DataSettings,
    load_conversations,
    prepare_dataset,
    prompt_key,
    split_heldout,
)
from draftsmith.errors import ConfigError, DataError

SYSTEM = "You are nice."
QUESTIONS = ["Hello there, how are you doing today?", "What is the weather like?", "What is your name?"]
ANSWERS = ["I am fine, thank you.", "It is sunny and warm.", "My name is Draftsmith. Nice to meet you!"]

# Renders earlier assistant turns as a placeholder (as templates that strip reasoning do), so a
# prefix of the conversation does not render as a prefix of the whole.
REWRITE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ (message['content'] if loop.last else 'ok') + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Closes the whole conversation with an extra EOS (as Phi-3's template does): a rendering up to an
# assistant turn then ends differently from the same turn inside the whole.
EOS_AT_END_TEMPLATE = tiny.CHATML_TEMPLATE + "{% if not add_generation_prompt %}{{ '<|endoftext|>' }}{% endif %}"


def conversation(i: int = 0, turns: int = 2, system: bool = True) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[(i + t) % 3]} (#{i})"})
        messages.append({"role": "assistant", "content": ANSWERS[(i + t) % 3]})
    return messages


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run(tmp_path: Path, sources, tokenizer: Path, name: str = "out", **settings) -> tuple[dict, list, list]:
    out = tmp_path / name
    stats = prepare_dataset(sources, tokenizer, out, DataSettings(**settings))
    assert json.loads((out / "stats.json").read_text()) == stats
    return stats, read_jsonl(out / "train.jsonl"), read_jsonl(out / "heldout.jsonl")


def message_rows(n: int, prefix: str = "row") -> list[dict]:
    return [{"id": f"{prefix}{i}", "messages": conversation(i)} for i in range(n)]


# --- the loss mask ---------------------------------------------------------------------------


@pytest.mark.parametrize("template, end_of_turn", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_loss_mask_is_exactly_the_assistant_turns(template, end_of_turn, request):
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(f"{template}_tokenizer"))
    messages = conversation(0, turns=3)
    ids, mask = tokenize_conversation(tokenizer, messages)

    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False),
                            add_special_tokens=False)["input_ids"]
    # Each assistant turn is one masked run: its content and the token closing the turn; nothing
    # of the role headers, the system prompt or the user turns.
    assert masked_runs(tokenizer, ids, mask) == [a + end_of_turn for a in ANSWERS]
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    for text in [SYSTEM, *QUESTIONS, "assistant"]:
        assert text in unmasked


def test_loss_mask_follows_a_template_that_trims_content(llama3_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(llama3_tokenizer)
    messages = [{"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": "  " + ANSWERS[0] + "\n"}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert masked_runs(tokenizer, ids, mask) == [ANSWERS[0] + "<|eot_id|>"]


def test_loss_mask_when_the_template_closes_the_conversation_with_eos(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok", EOS_AT_END_TEMPLATE))
    ids, mask = tokenize_conversation(tokenizer, conversation(0, turns=2))
    assert tokenizer.decode(ids).endswith("<|endoftext|>")
    assert masked_runs(tokenizer, ids, mask) == [ANSWERS[0] + "<|im_end|>", ANSWERS[1] + "<|im_end|>"]


def test_template_that_rewrites_turns_falls_back_to_generation_markers(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok", REWRITE_TEMPLATE))
    ids, mask = tokenize_conversation(tokenizer, conversation(0, turns=2))
    assert masked_runs(tokenizer, ids, mask) == ["ok<|im_end|>", ANSWERS[1] + "<|im_end|>"]


def test_template_that_rewrites_turns_without_markers_is_an_error(tmp_path):
    template = REWRITE_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok", template))
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns") as e:
        tokenize_conversation(tokenizer, conversation(0, turns=2))
    assert "generation" in e.value.fix
    # In a run, such rows count as template_error (the held-out row too: it is rendered whole) and
    # the run fails saying why and how to fix the template.
    tiny.write_jsonl(tmp_path / "d.jsonl", message_rows(4))
    with pytest.raises(DataError, match="template_error=4") as e:
        prepare_dataset([tmp_path / "d.jsonl"], tmp_path / "tok", tmp_path / "out", DataSettings())
    assert "rewrites earlier turns" in e.value.where and "{% generation %}" in e.value.fix


GREETING = "Hi! How can I help?"
# Refuses a conversation whose turns (past the system prompt) do not alternate user/assistant from a
# user turn, as strict templates (Mistral's, Llama 2's) do with raise_exception.
ALTERNATING_TEMPLATE = (
    "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if (message['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}" + tiny.CHATML_TEMPLATE
)


def greeting_first(i: int = 0, turns: int = 2, system: bool = False) -> list[dict]:
    """A conversation the bot opens with a greeting (as many ShareGPT dumps do), then ``turns`` exchanges."""
    messages = conversation(i, turns, system)
    return [*messages[:int(system)], {"role": "assistant", "content": GREETING}, *messages[int(system):]]


@pytest.mark.parametrize("system", [False, True], ids=["greeting-first", "system-then-greeting"])
def test_an_opening_assistant_turn_is_context_and_the_answers_after_it_are_masked(chatml_tokenizer, system):
    from draftsmith.chat import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(chatml_tokenizer)
    messages = greeting_first(0, turns=2, system=system)
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False),
                            add_special_tokens=False)["input_ids"]
    assert masked_runs(tokenizer, ids, mask) == [ANSWERS[0] + "<|im_end|>", ANSWERS[1] + "<|im_end|>"]
    assert GREETING in tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    # The held-out prompt is the turns before the first answer: the greeting and the question.
    prompt = ChatRenderer(tokenizer).prompt_ids(messages)
    first_answer = 3 if system else 2
    assert prompt == tokenizer(tokenizer.apply_chat_template(messages[:first_answer], tokenize=False,
                                                             add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]
    assert prompt_key(messages) != prompt_key(messages[first_answer - 1:])


def test_an_opening_assistant_turn_gets_no_loss_under_generation_markers(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok", REWRITE_TEMPLATE))
    ids, mask = tokenize_conversation(tokenizer, greeting_first(0, turns=2))
    # the greeting and the first answer both render as "ok"; only the answer's is masked
    assert tokenizer.decode(ids).count("ok<|im_end|>") == 2
    assert masked_runs(tokenizer, ids, mask) == ["ok<|im_end|>", ANSWERS[1] + "<|im_end|>"]


def test_a_template_that_refuses_an_opening_assistant_turn_says_so(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok", ALTERNATING_TEMPLATE))
    assert tokenize_conversation(tokenizer, conversation(0))  # it renders alternating turns
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tokenizer, greeting_first(0))
    assert "refuses a conversation that opens with an assistant turn" in e.value.what
    assert "Conversation roles must alternate" in e.value.what
    assert "drop the assistant turns before the first user turn" in e.value.fix
    # Another refusal of the same template is its own, not blamed on an opening turn.
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tokenizer, [*greeting_first(0), conversation(1)[2]])  # two answers in a row
    assert "Conversation roles must alternate" in e.value.what and "opens with" not in e.value.what

    # In a run, such rows are template_error, counted against data.max_bad_fraction.
    rows = [*message_rows(30), {"id": "greets", "messages": greeting_first(30)}]
    stats, train, _ = run(tmp_path, [tiny.write_jsonl(tmp_path / "d.jsonl", rows)], tmp_path / "tok")
    assert stats["rows_dropped"]["template_error"] == 1 and "greets" not in {r["id"] for r in train}
    assert "opens with an assistant turn" in stats["first_bad_rows"][0]["detail"]


def test_rows_that_open_with_an_assistant_turn_train_on_their_answers(tmp_path, chatml_tokenizer):
    """30 chats, 2 the bot opens with a greeting, and one with nothing but the greeting before a user
    turn: the greeting rows train on their answers; the last is a bad row that says why."""
    greeting_only = {"id": "only", "conversations": [{"from": "gpt", "value": GREETING},
                                                      {"from": "human", "value": QUESTIONS[0]}]}
    rows = [*message_rows(28), {"id": "greets0", "messages": greeting_first(0)},
            {"id": "greets1", "messages": greeting_first(1, system=True)}, greeting_only]
    source = tiny.write_jsonl(tmp_path / "d.jsonl", rows)
    stats, train, held = run(tmp_path, [source], chatml_tokenizer, max_heldout=1)
    dropped = {reason: n for reason, n in stats["rows_dropped"].items() if n}
    assert dropped == {"no_assistant_turn": 1}
    (bad,) = stats["first_bad_rows"]
    assert bad["line"] == 31 and "no assistant turn follows a user or tool turn" in bad["detail"]
    assert "cannot render" not in bad["detail"]
    tokenizer = AutoTokenizer.from_pretrained(chatml_tokenizer)
    assert {r["id"] for r in train + held} >= {"greets0", "greets1"}
    trained = [r for r in train if r["id"].startswith("greets")]
    assert trained  # one row at most is held out
    for row in trained:
        assert GREETING in tokenizer.decode(row["input_ids"])
        runs = masked_runs(tokenizer, row["input_ids"], row["loss_mask"])
        assert len(runs) == 2 and GREETING not in "".join(runs)


# --- input formats ---------------------------------------------------------------------------


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved_dataset(path: Path, rows: list[dict], splits: tuple[str, ...] = ()) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({s: ds for s in splits}) if splits else ds).save_to_disk(str(path))
    return path


def sharegpt(messages: list[dict]) -> list[dict]:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


FORMATS = {
    "jsonl_messages": lambda d, rows: tiny.write_jsonl(d / "d.jsonl", rows),
    "jsonl_sharegpt": lambda d, rows: tiny.write_jsonl(
        d / "d.jsonl", [{"id": r["id"], "conversations": sharegpt(r["messages"])} for r in rows]),
    "json_list": lambda d, rows: (d / "d.json").write_text(json.dumps(rows)) and d / "d.json",
    "json_data": lambda d, rows: (d / "d.json").write_text(json.dumps({"data": rows})) and d / "d.json",
    "parquet": lambda d, rows: write_parquet(d / "d.parquet", rows),
    "saved_dataset": lambda d, rows: write_saved_dataset(d / "ds", rows),
    "saved_dataset_dict": lambda d, rows: write_saved_dataset(d / "ds", rows, ("train", "test")),
}


@pytest.mark.parametrize("kind", FORMATS)
def test_each_input_format_gives_the_same_rows(kind, tmp_path, chatml_tokenizer):
    rows = message_rows(6)
    source = FORMATS[kind](tmp_path, rows)
    stats, train, held = run(tmp_path, [source], chatml_tokenizer)
    reference = tiny.write_jsonl(tmp_path / "ref.jsonl", rows)
    _, ref_train, ref_held = run(tmp_path, [reference], chatml_tokenizer, name="ref")

    assert stats["rows_read"] == stats["rows_kept"] == 6
    assert sum(stats["rows_dropped"].values()) == 0
    strip = lambda rs: [{k: v for k, v in r.items() if k != "source"} for r in rs]  # noqa: E731
    assert strip(train) == strip(ref_train) and strip(held) == strip(ref_held)
    first_line = 1 if kind.startswith("jsonl") else 0  # jsonl: 1-based lines; others: 0-based row index
    assert {r["source"]["line"] for r in train + held} == set(range(first_line, first_line + 6))
    assert all(r["source"]["file"] == str(source) for r in train + held)


def test_plain_text_rows_train_with_full_loss_and_are_never_held_out(tmp_path, llama3_tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens."]
    source = tiny.write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts] + message_rows(3))
    stats, train, held = run(tmp_path, [source], llama3_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(llama3_tokenizer)
    text_rows = [r for r in train if r["id"] in ("t:1", "t:2")]
    # Plain text is tokenized as the tokenizer feeds text (its own BOS, if it adds one).
    assert [r["input_ids"] for r in text_rows] == [tokenizer(t)["input_ids"] for t in texts]
    assert all(set(r["loss_mask"]) == {1} for r in text_rows)
    assert stats["heldout_rows"] == 1 and held[0]["id"].startswith("row")


def test_content_parts_are_joined_and_non_text_parts_are_bad(tmp_path, chatml_tokenizer):
    parts = [{"type": "text", "text": "Hello there, "}, {"type": "text", "text": "how are you doing today?"}]
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    rows = [{"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": ANSWERS[0]}]},
            {"messages": [{"role": "user", "content": image}, {"role": "assistant", "content": ANSWERS[0]}]}]
    got = list(load_conversations([tiny.write_jsonl(tmp_path / "p.jsonl", rows)]))
    assert got[0].messages[0]["content"] == QUESTIONS[0]
    assert isinstance(got[1], BadRow) and got[1].reason == "non_text_content" and got[1].line == 2


def test_a_dataset_dict_without_train_split_names_its_splits(tmp_path, chatml_tokenizer):
    source = write_saved_dataset(tmp_path / "ds", message_rows(3), ("validation", "test"))
    with pytest.raises(DataError, match=r"\['test', 'validation'\]"):
        list(load_conversations([source]))


def test_trailing_turns_after_the_last_answer_are_dropped(tmp_path):
    rows = [{"messages": conversation(0) + [{"role": "user", "content": "bye"}]}]
    (row,) = load_conversations([tiny.write_jsonl(tmp_path / "d.jsonl", rows)])
    assert isinstance(row, Conversation) and row.messages == conversation(0) and row.id == "d:1"


def test_read_for_regeneration_prompts_and_empty_answers_are_the_targets_to_write(tmp_path):
    """Regeneration reads a conversation that ends with a user turn with an empty answer after it, and
    an empty answer as one to write; a conversation that uses tools, which it leaves as it is, and
    every row with regeneration off, are read as prepare_dataset reads them."""
    user = {"role": "user", "content": QUESTIONS[0]}
    answer = {"role": "assistant", "content": ANSWERS[0]}
    tool_use = [user, {"role": "assistant", "content": None,
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}]},
                {"role": "tool", "content": "sunny"}]
    rows = [{"messages": [user]},
            {"messages": [{"role": "system", "content": SYSTEM}, user, answer, user]},
            {"messages": [user, {"role": "assistant", "content": "  "}, user, {"role": "assistant", "content": None}]},
            {"messages": [*tool_use, answer, user]},
            {"messages": [*tool_use, {"role": "assistant", "content": ""}]}]
    source = tiny.write_jsonl(tmp_path / "r.jsonl", rows)
    empty = {"role": "assistant", "content": ""}
    prompt, follow_up, empty_answers, tools_cut, tools_empty = load_conversations([source], regenerating=True)
    assert prompt.messages == [user, empty]
    assert follow_up.messages == [{"role": "system", "content": SYSTEM}, user, answer, user, empty]
    assert empty_answers.messages == [user, {"role": "assistant", "content": "  "}, user, empty]
    assert tools_cut.messages[-1] == answer and len(tools_cut.messages) == 4
    assert isinstance(tools_empty, BadRow) and tools_empty.reason == "empty_turn"
    read = list(load_conversations([source]))
    assert [getattr(r, "reason", None) for r in read] == ["no_assistant_turn", None, "empty_turn", None, "empty_turn"]
    assert read[1].messages[-1] == answer


# --- bad rows --------------------------------------------------------------------------------


def write_bad_rows(path: Path) -> dict[int, str]:
    """A jsonl file with one row of each bad kind among good rows; returns {line: reason}."""
    user = {"role": "user", "content": QUESTIONS[0]}
    answer = {"role": "assistant", "content": ANSWERS[0]}
    bad = {
        2: ("invalid_json", b'{"messages": [}'),
        3: ("not_utf8", b'{"messages": "\xff\xfe"}'),
        4: ("missing_turns", {"messages": []}),
        5: ("empty_turn", {"messages": [{"role": "user", "content": "  "}, answer]}),
        6: ("unknown_role", {"messages": [{"role": "robot", "content": "42"}, answer]}),
        7: ("no_assistant_turn", {"messages": [user]}),
        8: ("non_text_content", {"messages": [user, {"role": "assistant", "content": 42}]}),
        9: ("unknown_format", {"prompt": "x", "completion": "y"}),
        10: ("too_long_prompt", {"messages": [{"role": "user", "content": " ".join(QUESTIONS * 8)}, answer]}),
        11: ("template_error", {"messages": [user, {"role": "assistant", "content": None,  # ChatML drops calls
                                                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}),
        12: ("missing_turns", {"conversations": None, "messages": None, "id": "nulls"}),
        13: ("invalid_unicode", b'{"messages": [{"role": "user", "content": "cut \\ud800 emoji"}, '
                                b'{"role": "assistant", "content": "ok"}]}'),
        14: ("invalid_tool_call", {"messages": [user, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": {"arguments": "{}"}}]}]}),
    }
    lines = []
    for line in range(1, 31):
        if line in bad:
            row = bad[line][1]
            lines.append(row if isinstance(row, bytes) else json.dumps(row).encode())
        else:
            lines.append(json.dumps({"messages": conversation(line)}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    # Line 12 has both keys null: with format auto that is "no known field".
    return {line: ("unknown_format" if line == 12 else reason) for line, (reason, _) in bad.items()}


def test_each_bad_row_kind_is_counted_with_its_line(tmp_path, chatml_tokenizer, caplog):
    source = tmp_path / "bad.jsonl"
    expected = write_bad_rows(source)
    stats, train, held = run(tmp_path, [source], chatml_tokenizer, max_seq_len=64, max_bad_fraction=0.5)

    want = {reason: 0 for reason in REASONS}
    for reason in expected.values():
        want[reason] += 1
    assert stats["rows_dropped"] == want
    assert stats["rows_read"] == 30 and stats["rows_kept"] == 30 - len(expected)
    assert {(b["line"], b["reason"]) for b in stats["first_bad_rows"]} <= set(expected.items())
    assert len(stats["first_bad_rows"]) == 10 and all(b["file"] == str(source) for b in stats["first_bad_rows"])
    assert f"{source}:2: invalid_json" in caplog.text
    kept_lines = {r["source"]["line"] for r in train + held}
    assert kept_lines.isdisjoint(expected)


def test_too_many_bad_rows_fail_with_counts_place_and_fix(tmp_path, chatml_tokenizer):
    source = tmp_path / "bad.jsonl"
    write_bad_rows(source)
    with pytest.raises(DataError) as e:
        prepare_dataset([source], chatml_tokenizer, tmp_path / "out", DataSettings(max_seq_len=64))
    message = str(e.value)
    assert "more than data.max_bad_fraction=0.2" in message
    assert "invalid_json=1" in message and "not_utf8=1" in message and "unknown_format=2" in message
    assert f"{source}:2 (invalid_json" in e.value.where
    assert "raise data.max_bad_fraction" in e.value.fix
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_an_empty_source_or_no_usable_row_is_an_error(tmp_path, chatml_tokenizer):
    good = tiny.write_jsonl(tmp_path / "good.jsonl", message_rows(3))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl holds no rows"):
        prepare_dataset([good, empty], chatml_tokenizer, tmp_path / "out", DataSettings())
    useless = tiny.write_jsonl(tmp_path / "useless.jsonl", [{"messages": []}])
    with pytest.raises(DataError, match="no usable rows in .*useless.jsonl"):
        prepare_dataset([useless], chatml_tokenizer, tmp_path / "out", DataSettings(max_bad_fraction=1.0))
    with pytest.raises(DataError, match="does not exist"):
        prepare_dataset([tmp_path / "missing.jsonl"], chatml_tokenizer, tmp_path / "out", DataSettings())


def test_a_tokenizer_without_chat_template_is_an_error_for_chat_rows_only(tmp_path):
    folder = tiny.build_tokenizer(tmp_path / "tok")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    chat = tiny.write_jsonl(tmp_path / "chat.jsonl", message_rows(3))
    with pytest.raises(DataError, match="no chat template") as e:
        prepare_dataset([chat], folder, tmp_path / "out", DataSettings())
    assert "chat_template" in e.value.fix
    # text rows need no template: what stops text alone is that it holds no prompt to evaluate on
    text = tiny.write_jsonl(tmp_path / "text.jsonl", [{"text": "one two three"}] * 3)
    with pytest.raises(DataError, match="no prompt to hold out for evaluation"):
        run(tmp_path, [text], folder)


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="data.heldout_fraction"):
        DataSettings(heldout_fraction=0.0)
    with pytest.raises(ConfigError, match="data.format"):
        DataSettings(format="csv")


# --- truncation, split, stats ----------------------------------------------------------------


def test_long_rows_are_truncated_to_max_seq_len(tmp_path, chatml_tokenizer):
    source = tiny.write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation(i, turns=3)} for i in range(10)])
    stats, train, _ = run(tmp_path, [source], chatml_tokenizer, max_seq_len=64)  # whole rows: ~140 tokens
    assert stats["truncated_rows"] == stats["train_rows"] == len(train) == 9
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == 64 and any(r["loss_mask"]) for r in train)
    assert stats["tokens"] == 9 * 64


def test_heldout_split_is_deterministic_and_disjoint_from_train(tmp_path, chatml_tokenizer):
    source = tiny.write_jsonl(tmp_path / "d.jsonl", message_rows(40))
    stats, train, held = run(tmp_path, [source], chatml_tokenizer, heldout_fraction=0.1, seed=3)
    run(tmp_path, [source], chatml_tokenizer, name="again", heldout_fraction=0.1, seed=3)
    for name in ("train.jsonl", "heldout.jsonl", "stats.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()

    train_ids, held_ids = {r["id"] for r in train}, {r["id"] for r in held}
    assert len(held_ids) == 4 and not train_ids & held_ids and train_ids | held_ids == {f"row{i}" for i in range(40)}
    tokenizer = AutoTokenizer.from_pretrained(chatml_tokenizer)
    for row in held:
        number = int(row["id"][3:])
        assert row["messages"] == conversation(number)
        prompt = tokenizer.apply_chat_template(conversation(number)[:2], tokenize=False, add_generation_prompt=True)
        assert row["prompt_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")

    keys = {f"row{i}": prompt_key(conversation(i)) for i in range(40)}
    shuffled = dict(random.Random(0).sample(sorted(keys.items()), 40))
    assert split_heldout(shuffled, DataSettings(heldout_fraction=0.1, seed=3)) == held_ids
    assert split_heldout(keys, DataSettings(heldout_fraction=0.1, seed=4)) != held_ids
    assert len(split_heldout(keys, DataSettings(heldout_fraction=0.001))) == 1
    assert len(split_heldout(keys, DataSettings(heldout_fraction=0.5, max_heldout=7))) == 7


def test_duplicate_ids_are_made_unique_and_counted(tmp_path, chatml_tokenizer):
    # Same ids, different conversations (identical prompts would be kept apart from held-out ones).
    rows = message_rows(3) + [{"id": f"row{i}", "messages": conversation(10 + i)} for i in range(2)]
    a = tiny.write_jsonl(tmp_path / "a.jsonl", rows)  # row0, row1 twice
    b = tiny.write_jsonl(tmp_path / "b.jsonl", [{"id": "row0", "messages": conversation(20)}])  # row0 a third time
    stats, train, held = run(tmp_path, [a, b], chatml_tokenizer)
    ids = sorted(r["id"] for r in train + held)
    assert ids == ["row0", "row0#2", "row0#3", "row1", "row1#2", "row2"]
    assert stats["duplicate_ids"] == 3


def test_rows_without_ids_in_two_sources_of_one_name_are_not_called_repeated(tmp_path, chatml_tokenizer, caplog):
    """a/train.jsonl and b/train.jsonl, no ids: each row's id is its file's stem and line, so the two
    files give the same ids; they are made unique, but the rows repeat no id of their own."""
    sources = []
    for k, name in enumerate("ab"):
        (tmp_path / name).mkdir()
        sources.append(tiny.write_jsonl(tmp_path / name / "train.jsonl",
                                        [{"messages": conversation(10 * k + i)} for i in range(3)]))
    stats, train, held = run(tmp_path, sources, chatml_tokenizer)
    assert sorted(r["id"] for r in train + held) == ["train:1", "train:1#2", "train:2", "train:2#2", "train:3", "train:3#2"]
    assert stats["duplicate_ids"] == 0
    assert not [r for r in caplog.records if "repeats the id" in r.getMessage()]


def test_stats_totals_agree_with_the_files(tmp_path, chatml_tokenizer):
    source = tmp_path / "bad.jsonl"
    write_bad_rows(source)
    stats, train, held = run(tmp_path, [source], chatml_tokenizer, max_seq_len=64, max_bad_fraction=0.5,
                             max_samples=10)
    assert stats["rows_read"] == stats["rows_kept"] + sum(stats["rows_dropped"].values()) \
        + stats["rows_over_max_samples"] + stats["rows_same_prompt_as_heldout"]
    # 19 rows survive reading, 1 is held out, 10 of the other 18 are sampled; a sampled row that
    # then fails (too long, template) is not replaced.
    assert stats["rows_over_max_samples"] == 8
    assert stats["train_rows"] == len(train) <= 10 and stats["heldout_rows"] == len(held) <= 1
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in train)
    assert stats["loss_tokens"] == sum(sum(r["loss_mask"]) for r in train)
    assert stats["heldout_prompt_tokens"] == sum(len(r["prompt_ids"]) for r in held)
    assert stats["max_seq_len"] == 64


def test_a_held_out_prompt_never_appears_in_training(tmp_path, chatml_tokenizer):
    # The same question with different answers (common in chat corpora): once one is held out,
    # the others must not train the draft on the evaluation prompt.
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": "What is your name?"},
                                         {"role": "assistant", "content": f"Answer number {i}."}]}
            for i in range(5)]
    rows += [{"id": f"other{i}", "messages": [{"role": "user", "content": f"Hello there {i}"},
                                              {"role": "assistant", "content": "Hi."}]} for i in range(15)]
    source = tiny.write_jsonl(tmp_path / "dupes.jsonl", rows)
    stats, train, held = run(tmp_path, [source], chatml_tokenizer, heldout_fraction=0.3)
    held_prompts = {json.dumps(r["messages"][:1]) for r in held}
    assert held_prompts
    train_ids = {r["id"] for r in train}
    for row in rows:
        if json.dumps(row["messages"][:1]) in held_prompts:
            assert row["id"] not in train_ids
    assert stats["rows_same_prompt_as_heldout"] == sum(
        json.dumps(r["messages"][:1]) in held_prompts for r in rows) - len(held)


def test_every_row_sharing_a_held_out_prompt_is_diagnosed_as_such(tmp_path, chatml_tokenizer):
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": "What is your name?"},
                                         {"role": "assistant", "content": f"Answer number {i}."}]}
            for i in range(6)]
    source = tiny.write_jsonl(tmp_path / "one_prompt.jsonl", rows)
    with pytest.raises(DataError) as e:
        prepare_dataset([source], chatml_tokenizer, tmp_path / "out", DataSettings())
    assert "shares its prompt" in e.value.what and "same prompt as a held-out row: 5" in e.value.what
    assert "distinct prompts" in e.value.fix and "max_seq_len" not in str(e.value)
    assert not (tmp_path / "out" / "train.jsonl").exists()


def seed_where(source: Path, holds, **settings) -> int:
    """The first seed whose held-out split of ``source`` (a set of ids) satisfies ``holds``."""
    keys = {row.id: prompt_key(row.messages, row.tools) for row in load_conversations([source])}
    return next(seed for seed in range(200) if holds(split_heldout(keys, DataSettings(seed=seed, **settings))))


def test_each_prompt_is_held_out_once_and_kept_out_of_training(tmp_path, chatml_tokenizer, caplog):
    """A prompt asked in several rows is one held-out prompt, decoded once: heldout_fraction is a share
    of the distinct prompts, and every other row asking it stays out of training."""
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": "What is your name?"},
                                         {"role": "assistant", "content": f"Answer number {i}."}]}
            for i in range(10)]
    rows += [{"id": f"other{i}", "messages": [{"role": "user", "content": f"Hello there {i}"},
                                              {"role": "assistant", "content": "Hi."}]} for i in range(10)]
    source = tiny.write_jsonl(tmp_path / "repeated.jsonl", rows)
    repeated = {f"q{i}" for i in range(10)}
    seed = seed_where(source, lambda held: held & repeated, heldout_fraction=0.5)  # the repeated prompt held out
    with caplog.at_level("INFO", logger="draftsmith.data"):
        stats, train, held = run(tmp_path, [source], chatml_tokenizer, heldout_fraction=0.5, seed=seed)
    prompts = [json.dumps(r["messages"][:1]) for r in held]
    assert len(set(prompts)) == len(prompts) == stats["heldout_rows"] == round(0.5 * 11)  # 11 distinct prompts
    assert len({r["id"] for r in held} & repeated) == 1 and not {r["id"] for r in train} & repeated
    assert stats["rows_same_prompt_as_heldout"] == 9
    assert "9 rows kept out of training for a held-out prompt" in caplog.text


def test_text_alone_is_refused_for_want_of_prompts_to_hold_out(tmp_path, chatml_tokenizer):
    """Plain text holds no prompt: evaluate_draft would find no held-out prompt after extraction
    and training; prepare_dataset says so first."""
    source = tiny.write_jsonl(tmp_path / "text.jsonl", [{"text": f"{QUESTIONS[i % 3]} {ANSWERS[i % 3]}"}
                                                        for i in range(12)])
    with pytest.raises(DataError) as e:
        prepare_dataset([source], chatml_tokenizer, tmp_path / "out", DataSettings(format="text"))
    assert "no prompt to hold out for evaluation" in e.value.what and "all 12 usable rows are plain text" in e.value.what
    assert "add conversation rows" in e.value.fix
    assert not any((tmp_path / "out" / name).exists() for name in ("train.jsonl", "heldout.jsonl", "stats.json"))


def test_a_split_whose_held_out_rows_are_all_bad_is_refused(tmp_path, chatml_tokenizer):
    """The rows held out turn out bad (the plain ChatML template drops tool calls): no prompt would be
    left to evaluate on, so prepare_dataset stops, naming the row and the fix."""
    rows = message_rows(10) + [tool_conversation(i) for i in range(2)]
    source = tiny.write_jsonl(tmp_path / "mixed.jsonl", rows)
    seed = seed_where(source, lambda held: held <= {"tool0", "tool1"})
    with pytest.raises(DataError) as e:
        prepare_dataset([source], chatml_tokenizer, tmp_path / "out", DataSettings(seed=seed, max_bad_fraction=0.5))
    assert "no held-out prompt left" in e.value.what and "(template_error=1)" in e.value.what
    assert f"first held-out bad row {source}:" in e.value.where and "tool calls" in e.value.where
    assert "tool-use chat template" in e.value.fix and "raise data.heldout_fraction" in e.value.fix
    assert not any((tmp_path / "out" / name).exists() for name in ("train.jsonl", "heldout.jsonl", "stats.json"))


def test_nothing_left_names_the_reason_that_removed_the_rows(tmp_path, chatml_tokenizer):
    # Rows whose only answer gets no token once truncated, with every bad row allowed.
    long = " ".join(QUESTIONS * 8)
    rows = [{"messages": [{"role": "user", "content": f"{QUESTIONS[0]} {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(2)]
    rows += [{"messages": [{"role": "user", "content": f"{long} {i}"}, {"role": "assistant", "content": "ok"}]}
             for i in range(6)]
    source = tiny.write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError) as e:
        prepare_dataset([source], chatml_tokenizer, tmp_path / "out",
                        DataSettings(max_seq_len=24, max_bad_fraction=1.0, heldout_fraction=0.5))
    assert "too_long_prompt: " in e.value.what and "raise data.max_seq_len (now 24)" == e.value.fix


# --- tools, tool calls, multi-part content ---------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def tool_conversation(i: int = 0, arguments: str | dict = '{"city": "Paris"}') -> dict:
    """An OpenAI-style agentic row: tools, a tool call with JSON-string arguments, its result, an answer."""
    return {"id": f"tool{i}", "tools": TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                     {"type": "text", "text": f"in Paris? (#{i})"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 25 degrees"},
        {"role": "assistant", "content": ANSWERS[1]}]}


@pytest.mark.parametrize("template, call, end_of_turn", [
    ("chatml_tools", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "<|im_end|>"),
    ("llama3_tools", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|eot_id|>"),
])
def test_tool_calls_are_rendered_by_the_template_and_trained_on_tool_results_are_not(
        template, call, end_of_turn, request, tmp_path):
    folder = request.getfixturevalue(f"{template}_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    (row,) = load_conversations([tiny.write_jsonl(tmp_path / "t.jsonl", [tool_conversation()])])
    assert isinstance(row, Conversation) and row.tools == TOOLS
    assert [m["role"] for m in row.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert row.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}

    ids, mask = tokenize_conversation(tokenizer, row.messages, row.tools)
    # The same tokens as the template renders with tools=, as the served target sees them.
    rendered = tokenizer.apply_chat_template(row.messages, tools=row.tools, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert masked_runs(tokenizer, ids, mask) == [call + end_of_turn, ANSWERS[1] + end_of_turn]
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    for text in ["sunny and 25 degrees", "Weather of a city", "in Paris? (#0)", SYSTEM]:
        assert text in unmasked


def test_agentic_rows_go_through_prepare_dataset(tmp_path, chatml_tools_tokenizer):
    rows = [tool_conversation(i) for i in range(8)]
    rows[3] = tool_conversation(3, arguments={"city": "Paris"})  # arguments already an object
    source = tiny.write_jsonl(tmp_path / "agentic.jsonl", rows)
    stats, train, held = run(tmp_path, [source], chatml_tools_tokenizer)
    assert sum(stats["rows_dropped"].values()) == 0 and stats["train_rows"] + stats["heldout_rows"] == 8
    assert held[0]["tools"] == TOOLS
    tokenizer = AutoTokenizer.from_pretrained(chatml_tools_tokenizer)
    prompt = tokenizer.decode(held[0]["prompt_ids"])
    assert "get_weather" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_drops_tool_calls_makes_the_row_bad(tmp_path, chatml_tokenizer):
    # The plain ChatML template renders content only: a tool-call turn would train on nothing.
    source = tiny.write_jsonl(tmp_path / "agentic.jsonl", [tool_conversation(i) for i in range(4)]
                              + message_rows(8))
    # several prompts held out, so that a clean one is among them
    stats, train, _ = run(tmp_path, [source], chatml_tokenizer, max_bad_fraction=0.5, heldout_fraction=0.3)
    assert stats["rows_dropped"]["template_error"] == 4
    assert "does not render the assistant's tool calls" in stats["first_bad_rows"][0]["detail"]


def test_rows_the_template_cannot_render_are_bad_rows_wherever_they_are(tmp_path, chatml_tokenizer):
    """Clean rows first (preflight sees only those), tool-call rows after: every one is counted,
    held out or not, named with file:line, and held to data.max_bad_fraction."""
    rows = message_rows(12) + [tool_conversation(i) for i in range(4)]
    source = tiny.write_jsonl(tmp_path / "mixed.jsonl", rows)
    for seed in range(4):  # held-out draws that do and do not pick a tool row
        stats, train, held = run(tmp_path, [source], chatml_tokenizer, name=f"s{seed}", seed=seed,
                                 heldout_fraction=0.3, max_bad_fraction=0.5)
        assert stats["rows_dropped"]["template_error"] == 4
        assert [(r["file"], r["line"]) for r in stats["first_bad_rows"]] == [(str(source), n) for n in range(13, 17)]
        assert not any(r["id"].startswith("tool") for r in train + held)
    with pytest.raises(DataError) as info:
        run(tmp_path, [source], chatml_tokenizer, name="strict", max_bad_fraction=0.2)
    assert "template_error=4" in info.value.what and f"{source}:13" in info.value.where


def test_tool_rows_in_sharegpt_and_parquet_shapes(tmp_path):
    # ShareGPT function-calling sets name tool results "observation"; parquet stores tools as a JSON string.
    rows = [{"conversations": [{"from": "human", "value": "Weather?"},
                               {"from": "gpt", "value": "", "tool_calls": [
                                   {"function": {"name": "get_weather", "arguments": "{}"}}]},
                               {"from": "observation", "value": "sunny"},
                               {"from": "gpt", "value": "Sunny."}], "tools": json.dumps(TOOLS)}]
    (row,) = load_conversations([write_parquet(tmp_path / "t.parquet", rows)])
    assert isinstance(row, Conversation) and row.tools == TOOLS
    assert [m["role"] for m in row.messages] == ["user", "assistant", "tool", "assistant"]


def test_a_tokenizer_that_raises_costs_only_the_row(tmp_path, chatml_tokenizer, monkeypatch):
    from draftsmith import chat

    real = chat.encode_text

    def rust_error(text, **kwargs):  # what the Rust tokenizer raised on a lone surrogate
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")

    def fussy(tokenizer, text, **kwargs):
        return real(rust_error if "(#3)" in text else tokenizer, text, **kwargs)

    monkeypatch.setattr(chat, "encode_text", fussy)
    source = tiny.write_jsonl(tmp_path / "d.jsonl", message_rows(12))
    stats, train, held = run(tmp_path, [source], chatml_tokenizer)
    assert stats["rows_dropped"]["tokenizer_error"] >= 1
    bad = [b for b in stats["first_bad_rows"] if b["reason"] == "tokenizer_error"]
    assert bad[0]["line"] == 4 and "TextEncodeInput" in bad[0]["detail"]


def test_a_lone_surrogate_is_a_bad_row_not_a_crash(tmp_path, chatml_tokenizer):
    source = tmp_path / "s.jsonl"
    lines = [json.dumps(r) for r in message_rows(10)]
    lines[4] = '{"messages": [{"role": "user", "content": "half an emoji \\ud83d"}, {"role": "assistant", "content": "ok"}]}'
    lines[6] = '{"text": "\\udfff"}'
    source.write_text("\n".join(lines) + "\n")
    stats, train, held = run(tmp_path, [source], chatml_tokenizer)
    assert stats["rows_dropped"]["invalid_unicode"] == 2 and stats["rows_kept"] == 8
    assert {(b["line"], b["reason"]) for b in stats["first_bad_rows"]} == {(5, "invalid_unicode"), (7, "invalid_unicode")}


# --- compressed sources and file modes -------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl.gz", "json.gz", "parquet-zstd", "parquet-gzip", "parquet-brotli"])
def test_compressed_sources_give_the_same_rows(kind, tmp_path, chatml_tokenizer):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = message_rows(6)
    if kind == "jsonl.gz":
        source = tmp_path / "d.jsonl.gz"
        source.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif kind == "json.gz":
        source = tmp_path / "d.json.gz"
        source.write_bytes(gzip.compress(json.dumps(rows).encode()))
    else:
        source = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), source, compression=kind.split("-")[1])
    _, train, held = run(tmp_path, [source], chatml_tokenizer)
    _, ref_train, ref_held = run(tmp_path, [tiny.write_jsonl(tmp_path / "ref.jsonl", rows)], chatml_tokenizer,
                                 name="ref")
    strip = lambda rs: [{k: v for k, v in r.items() if k != "source"} for r in rs]  # noqa: E731
    assert strip(train) == strip(ref_train) and strip(held) == strip(ref_held)
    if kind == "jsonl.gz":
        assert {r["source"]["line"] for r in train + held} == set(range(1, 7))


def test_a_misnamed_or_damaged_compressed_source_is_refused(tmp_path, chatml_tokenizer):
    import gzip

    plain = tiny.write_jsonl(tmp_path / "d.jsonl.gz", message_rows(3))  # not compressed
    with pytest.raises(DataError, match="not gzip-compressed"):
        list(load_conversations([plain]))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in message_rows(200)).encode())[:600])
    with pytest.raises(DataError, match="cannot be decompressed") as e:
        list(load_conversations([cut]))
    assert "re-create" in e.value.fix


def test_dataset_files_are_written_with_the_mode_of_other_outputs(tmp_path, chatml_tokenizer):
    source = tiny.write_jsonl(tmp_path / "d.jsonl", message_rows(4))
    run(tmp_path, [source], chatml_tokenizer)
    modes = {name: (tmp_path / "out" / name).stat().st_mode & 0o777
             for name in ("train.jsonl", "heldout.jsonl", "stats.json")}
    assert len(set(modes.values())) == 1 and modes["train.jsonl"] & 0o044, modes


# --- worker processes ------------------------------------------------------------------------


def mixed_sources(folder: Path) -> list[Path]:
    """Rows of every kind in two sources: bad rows of each reading kind early, rows that repeat
    ids, text rows, rows that share a held-out prompt, and, late in the second source, bad rows
    that reading finds (invalid JSON) and that only rendering finds (tool calls the plain ChatML
    template drops, a prompt longer than max_seq_len)."""
    early = folder / "early.jsonl"
    write_bad_rows(early)
    rows = message_rows(150) + [{"id": f"row{i}", "messages": conversation(200 + i)} for i in range(10)]
    rows += [{"text": f"{QUESTIONS[i % 3]} {ANSWERS[i % 3]} {i}"} for i in range(20)]
    rows += [{"id": f"same{i}", "messages": [{"role": "user", "content": QUESTIONS[0]},
                                             {"role": "assistant", "content": f"Answer {i}."}]} for i in range(10)]
    lines = [json.dumps(r) for r in rows]
    lines += ['{"messages": [', json.dumps(tool_conversation(0)), json.dumps({"messages": [
        {"role": "user", "content": " ".join(QUESTIONS * 8)}, {"role": "assistant", "content": "ok"}]}),
        json.dumps({"messages": conversation(999)})]
    late = folder / "late.jsonl"
    late.write_text("\n".join(lines) + "\n")
    return [early, late]


def test_the_output_is_the_same_for_any_number_of_workers(tmp_path, chatml_tokenizer, monkeypatch, caplog):
    """Files, stats and the bad rows logged are the same whatever the number of workers, with
    chunks small enough that each worker takes several."""
    import draftsmith.data

    monkeypatch.setattr(draftsmith.data, "CHUNK_ROWS", 16)
    sources = mixed_sources(tmp_path)
    outputs, logged = {}, {}
    for workers in (1, 2, 3):
        caplog.clear()
        out = tmp_path / f"workers{workers}"
        # seed 7: a draw that holds out the prompt the ten "same" rows share
        stats = prepare_dataset(sources, chatml_tokenizer, out, DataSettings(
            max_seq_len=64, max_bad_fraction=0.5, heldout_fraction=0.05, max_samples=150, seed=7), workers=workers)
        outputs[workers] = {name: (out / name).read_bytes() for name in ("train.jsonl", "heldout.jsonl", "stats.json")}
        logged[workers] = [r.getMessage() for r in caplog.records if r.name.startswith("draftsmith.")]
    assert outputs[2] == outputs[1] and outputs[3] == outputs[1]
    assert logged[2] == logged[1] and logged[3] == logged[1]
    # Rows of each fate took part, so the comparison covers them all.
    assert stats["duplicate_ids"] == 10 and stats["rows_dropped"]["invalid_json"] == 2  # one early, one late
    assert stats["rows_over_max_samples"] and stats["rows_same_prompt_as_heldout"] and stats["truncated_rows"]
    assert stats["heldout_rows"] and stats["rows_dropped"]["template_error"] and len(stats["first_bad_rows"]) == 10


@pytest.mark.parametrize("late", ["invalid_json", "template_error"])
def test_too_many_bad_rows_late_fail_the_same_for_any_number_of_workers(late, tmp_path, chatml_tokenizer,
                                                                        monkeypatch):
    """Bad rows only at the end of the data, found by reading (invalid JSON) or only by rendering
    (tool calls the template drops): the same error, naming the first of them, and no output."""
    import draftsmith.data

    monkeypatch.setattr(draftsmith.data, "CHUNK_ROWS", 8)
    bad = ['{"messages": ['] * 12 if late == "invalid_json" else [json.dumps(tool_conversation(i)) for i in range(12)]
    source = tmp_path / "late.jsonl"
    source.write_text("\n".join([json.dumps(r) for r in message_rows(40)] + bad) + "\n")
    errors = []
    for workers in (1, 2):
        with pytest.raises(DataError) as info:
            prepare_dataset([source], chatml_tokenizer, tmp_path / f"w{workers}", DataSettings(), workers=workers)
        errors.append(str(info.value))
        assert not (tmp_path / f"w{workers}" / "train.jsonl").exists()
    assert errors[0] == errors[1]
    assert f"{late}=12" in errors[0] and f"first bad row {source}:41 ({late}" in errors[0]


def test_a_source_changed_between_the_two_reads_is_an_error_for_any_number_of_workers(tmp_path, chatml_tokenizer,
                                                                                     monkeypatch):
    import draftsmith.data

    source = tiny.write_jsonl(tmp_path / "d.jsonl", message_rows(40))
    real = draftsmith.data.read_rows
    reads = []

    def edited_on_the_second_read(sources, max_line):
        reads.append(1)
        for file, line, raw in real(sources, max_line):
            yield file, line, raw.replace(b'"row30"', b'"edited"') if len(reads) % 2 == 0 else raw

    monkeypatch.setattr(draftsmith.data, "read_rows", edited_on_the_second_read)
    for workers in (1, 2):
        with pytest.raises(DataError, match="changed while it was being read") as info:
            prepare_dataset([source], chatml_tokenizer, tmp_path / f"w{workers}", DataSettings(), workers=workers)
        assert info.value.where == f"{source}:31" and "do not modify" in info.value.fix


# --- fuzz: any row shape is a row or a bad row, never a crash ---------------------------------


def _odd(rng: random.Random, depth: int = 0):
    choices = [None, "", " ", "text", "\ud800", 0, -1, 2.5, True, [], {}, "[1, 2]", '{"a": 1}']
    if depth < 3:
        choices += [[_odd(rng, depth + 1) for _ in range(rng.randint(1, 3))],
                    {rng.choice(["role", "content", "from", "value", "type", "text", "tool_calls", "function",
                                 "name", "arguments", "tools", "id"]): _odd(rng, depth + 1)
                     for _ in range(rng.randint(1, 3))}]
    return rng.choice(choices)


def _mutated_row(rng: random.Random) -> dict:
    row = copy.deepcopy(tool_conversation(rng.randint(0, 99)) if rng.random() < 0.5 else {"messages": conversation(1)})
    for _ in range(rng.randint(1, 3)):
        target = row
        path = rng.choice([("messages",), ("tools",), ("messages", "turn"), ("messages", "turn", "key")])
        if path == ("messages",) or path == ("tools",):
            row[path[0]] = _odd(rng)
            continue
        turns = row.get("messages")
        if not isinstance(turns, list) or not turns:
            continue
        k = rng.randrange(len(turns))
        if len(path) == 2:
            turns[k] = _odd(rng)
        elif isinstance(turns[k], dict):
            target = turns[k]
            target[rng.choice(["role", "content", "tool_calls", "tool_call_id", "name"])] = _odd(rng)
    return row


@pytest.mark.parametrize("template", ["chatml", "chatml_tools", "llama3_tools"])
def test_fuzz_row_shapes_are_rows_or_bad_rows(template, tmp_path, request):
    """Mutated rows (odd types, lone surrogates, broken tool calls) read as a usable row or a
    counted bad row, and prepare_dataset finishes or raises a DataError, never another exception."""
    rng = random.Random(template)
    rows = [_mutated_row(rng) for _ in range(150)] + message_rows(10)
    source = tmp_path / "fuzz.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    read = list(load_conversations([source]))
    assert len(read) == len(rows) and all(isinstance(r, (Conversation, BadRow)) for r in read)
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(f"{template}_tokenizer"))
    for row in read:
        if isinstance(row, Conversation) and row.is_chat:
            try:
                tokenize_conversation(tokenizer, row.messages, row.tools)
            except DataError:
                pass
    try:
        prepare_dataset([source], request.getfixturevalue(f"{template}_tokenizer"), tmp_path / "out",
                        DataSettings(max_seq_len=256, max_bad_fraction=1.0))
    except DataError:
        pass


def test_parquet_values_json_cannot_hold_make_a_bad_row(tmp_path):
    import datetime

    call = {"type": "function", "function": {"name": "remind", "arguments": {"when": datetime.datetime(2026, 1, 1)}}}
    row = {"messages": [{"role": "user", "content": "Remind me.", "tool_calls": None},
                        {"role": "assistant", "content": "", "tool_calls": [call]}]}
    (got,) = load_conversations([write_parquet(tmp_path / "t.parquet", [row])])
    assert isinstance(got, BadRow) and got.reason == "invalid_tool_call" and "not JSON" in got.detail


# ---------------------------------------------------------------------------------------------
# Evaluation prompt sets (eval.sources)


def test_prompt_sets_are_read_in_the_benchmarks_shapes(tmp_path):
    """MT-bench (turns), HumanEval (prompt, task_id), GSM8K (question), conversations with or
    without an answer: each becomes the turns before the first answer; a row without a prompt is
    a bad row."""
    from draftsmith.bad_rows import BadRow
    from draftsmith.conversations import load_prompts

    source = tiny.write_jsonl(tmp_path / "mixed.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "canonical_solution": "    return a + b"},
        {"question": "What is 2 + 3?", "answer": "5"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]},
        {"conversations": [{"from": "human", "value": "Only a question"}]},
        {"answer": "no prompt here"},
        {"messages": [{"role": "assistant", "content": "an answer to nothing"}]},
        {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Hello"},
                           {"from": "gpt", "value": "An answer"}]},
        # TRL's conversational prompt-only rows: the prompt's turns under "prompt"
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
        # the same with ShareGPT's keys, and turns as a list of turns rather than MT-bench's strings
        {"prompt": [{"from": "human", "value": "Name a fruit."}]},
        {"turns": [{"role": "user", "content": "Name a tree."}]},
    ])
    rows = list(load_prompts([source]))
    assert [r.id for r in rows[:3]] == ["81", "HumanEval/0", "mixed:3"]
    assert rows[0].messages == [{"role": "user", "content": "Write a poem."}]
    assert rows[1].messages == [{"role": "user", "content": "def add(a, b):\n"}]
    assert rows[2].messages == [{"role": "user", "content": "What is 2 + 3?"}]
    assert [m["role"] for m in rows[3].messages] == ["system", "user"]
    assert rows[4].messages == [{"role": "user", "content": "Only a question"}]
    assert isinstance(rows[5], BadRow) and rows[5].reason == "unknown_format" and "question" in rows[5].detail
    assert isinstance(rows[6], BadRow) and rows[6].reason == "missing_turns"
    # a greeting that opens the conversation is part of the prompt before the first answer
    assert [m["content"] for m in rows[7].messages] == ["Hi!", "Hello"]
    assert rows[8].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert rows[9].messages == [{"role": "user", "content": "Name a fruit."}]
    assert rows[10].messages == [{"role": "user", "content": "Name a tree."}]


def test_prepare_eval_prompts_renders_prompts_as_the_heldout_split(tmp_path):
    from draftsmith.chat import ChatRenderer, load_tokenizer
    from draftsmith.eval_prompts import EvalPromptsSettings, prepare_eval_prompts
    from draftsmith.evaluate import read_prompts

    model = tiny.build_llama(tmp_path / "model")
    source = tiny.write_jsonl(tmp_path / "gsm8k.jsonl",
                              [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
                              + ["{broken"])
    out = tmp_path / "eval_sources" / "gsm8k.jsonl"
    stats = prepare_eval_prompts(source, model, out, EvalPromptsSettings(max_prompts=4, max_seq_len=64,
                                                                          max_bad_fraction=0.5))
    assert stats["prompts"] == 4 and stats["rows_read"] == 4  # stops once max_prompts are kept
    renderer = ChatRenderer(load_tokenizer(model))
    prompts = read_prompts(out)
    assert [p.ids for p in prompts] == [renderer.prompt_ids([{"role": "user", "content": f"What is {i} + {i}?"}])
                                        for i in range(4)]
    assert json.loads(out.with_suffix(".stats.json").read_text()) == stats

    # the same bad-row handling as prepare_dataset: too many bad rows stop it, naming the first
    bad = tiny.write_jsonl(tmp_path / "bad.jsonl", ["{broken", "{broken", {"question": "ok?"}])
    with pytest.raises(DataError, match="invalid_json=2") as error:
        prepare_eval_prompts(bad, model, tmp_path / "bad_out.jsonl",
                             EvalPromptsSettings(max_prompts=4, max_seq_len=64, max_bad_fraction=0.2))
    assert f"{bad}:1" in str(error.value) and not (tmp_path / "bad_out.jsonl").exists()
    long = tiny.write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200}])
    with pytest.raises(DataError, match="no usable prompt") as error:
        prepare_eval_prompts(long, model, tmp_path / "long_out.jsonl",
                             EvalPromptsSettings(max_prompts=4, max_seq_len=64, max_bad_fraction=1.0))
    assert "data.max_seq_len" in str(error.value)


def test_eval_prompt_sets_keep_the_input_the_context_and_the_system_prompt(tmp_path):
    """Alpaca's input and Dolly's context follow the instruction in its user turn (Alpaca's layout);
    a row's system field is a system turn the chat template renders, in prompt-field and chat rows."""
    from draftsmith.chat import ChatRenderer, load_tokenizer
    from draftsmith.eval_prompts import EvalPromptsSettings, prepare_eval_prompts
    from draftsmith.evaluate import read_prompts

    model = tiny.build_llama(tmp_path / "model")
    rows = [{"instruction": "Summarize the text.", "input": "The sun is warm.", "output": "Warm sun."},
            {"instruction": "Who wrote it?", "context": "Ann wrote the book.", "response": "Ann.",
             "category": "closed_qa"},
            {"instruction": "Say hi.", "input": ""},  # Alpaca rows without input: the instruction alone
            {"system": "Answer in French.", "question": "What is 2 + 2?"},
            {"system": "Be brief.", "messages": [{"role": "user", "content": "Hello?"}]},
            {"system": "Be brief.", "conversations": [{"from": "system", "value": "Its own."},
                                                      {"from": "human", "value": "Hi?"}]}]
    out = tmp_path / "set.jsonl"
    prepare_eval_prompts(tiny.write_jsonl(tmp_path / "alpaca.jsonl", rows), model, out,
                         EvalPromptsSettings(max_prompts=8, max_seq_len=64, max_bad_fraction=0.0))
    expected = [[{"role": "user", "content": "Summarize the text.\n\nThe sun is warm."}],
                [{"role": "user", "content": "Who wrote it?\n\nAnn wrote the book."}],
                [{"role": "user", "content": "Say hi."}],
                [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is 2 + 2?"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}],
                [{"role": "system", "content": "Its own."}, {"role": "user", "content": "Hi?"}]]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"] for r in written] == expected
    renderer = ChatRenderer(load_tokenizer(model))
    assert [p.ids for p in read_prompts(out)] == [renderer.prompt_ids(m) for m in expected]
