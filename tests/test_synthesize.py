"""Conversations the target writes itself (data.sources: [self]): the user turn found in any chat
template, requests filtered and counted, chunks resumed, the wanted count met or refused early, and
the stage end to end with a real tiny model in transformers and in vLLM."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import tiny
from draftsmith.chat import user_turn
from draftsmith.errors import DataError
from draftsmith.regenerate.answering import Regenerator
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.synthesize import (
    SynthesizeSettings,
    drop_reason,
    scripts_of,
    synthesize_chunk,
    synthesize_conversations,
)
from tiny_vllm import vllm_test


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path_factory.mktemp("chatml"), tiny.CHATML_TEMPLATE))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path_factory.mktemp("llama3"), tiny.LLAMA3_TEMPLATE))


def test_the_user_turn_of_a_chat_template(chatml, llama3):
    """The tokens a template renders before the user's text, and the special token that ends the turn."""
    turn = user_turn(chatml, None, "t")
    assert chatml.decode(turn.opening) == "<|im_start|>user\n"
    assert chatml.convert_ids_to_tokens(turn.closing) == ["<|im_end|>"]
    steered = user_turn(chatml, "You write Python.", "t")
    assert chatml.decode(steered.opening) == "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\n"
    turn = user_turn(llama3, None, "t")
    assert llama3.decode(turn.opening).endswith("<|start_header_id|>user<|end_header_id|>\n\n")
    assert llama3.convert_ids_to_tokens(turn.closing) == ["<|eot_id|>"]


def test_an_end_of_turn_that_is_an_added_special_token_outside_the_special_tokens_map(tmp_path):
    """Many tokenizers name another eos than the token that ends a turn (a base model's, or a GGUF
    conversion's); the end of turn is still one of the tokenizer's added special tokens."""
    from transformers import AutoTokenizer

    folder = tiny.build_tokenizer(tmp_path / "chatml", tiny.CHATML_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder, eos_token="<|endoftext|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in tokenizer.all_special_ids
    assert tokenizer.convert_ids_to_tokens(user_turn(tokenizer, None, "t").closing) == ["<|im_end|>"]


def test_a_template_without_a_special_end_of_turn_is_refused(tmp_path):
    from transformers import AutoTokenizer

    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer(tmp_path / "plain", plain))
    with pytest.raises(DataError, match="closes a user turn without a special token") as error:
        user_turn(tokenizer, None, "the target's chat template")
    assert error.value.where == "the target's chat template" and "data.sources of your own" in error.value.fix


def test_requests_are_kept_or_dropped_by_reason():
    settings = SynthesizeSettings(min_prompt_chars=8, scripts=("latin",))
    seen, excluded = {"how do i sort a list in python?"}, {"what is the capital of france?"}
    assert drop_reason(None, settings, seen, excluded) == "truncated"
    assert drop_reason("Hi!", settings, seen, excluded) == "short"
    assert drop_reason("Как отсортировать список в Python?", settings, seen, excluded) == "script"
    assert drop_reason("How do I  sort a list in Python?", settings, seen, excluded) == "duplicate"
    assert drop_reason("What is the capital of France?", settings, seen, excluded) == "evaluation"
    assert drop_reason("Write a haiku about autumn rain.", settings, seen, excluded) is None
    assert drop_reason("Как отсортировать список?", SynthesizeSettings(min_prompt_chars=8), seen, excluded) is None
    assert scripts_of("Ab 漢字")["CJK"] == 2 and scripts_of("Ab 漢字")["LATIN"] == 2


class Scripted(Regenerator):
    """A Regenerator whose model is a script: each call of ``generate`` takes the next texts (None:
    a turn that never ends), as token ids closed by ``end``."""

    def __init__(self, tokenizer, settings, end: int, script) -> None:
        self.tokenizer, self.settings, self.seed = tokenizer, settings, settings.seed
        self.stop_ids, self.on_answers, self.script, self.calls = [end], None, iter(script), []

    def generate(self, prompts, seed):
        self.calls.append((len(prompts), seed))
        texts = next(self.script)
        assert len(texts) == len(prompts)
        never_ends = self.tokenizer("word " * 80, add_special_tokens=False)["input_ids"]
        return [never_ends if t is None else self.tokenizer(t, add_special_tokens=False)["input_ids"] + self.stop_ids
                for t in texts]


def _collect(tmp_path, chatml, script, answers, max_bad_fraction=0.5, **settings):
    from draftsmith.regenerate.answering import check_answers
    from draftsmith.synthesize import _collect as collect

    end = chatml.convert_tokens_to_ids("<|im_end|>")
    synth = SynthesizeSettings(**{"chunk_size": 4, "conversations": 3, "min_prompt_chars": 4, **settings})
    regen = RegenerateSettings(max_new_tokens=8, max_bad_fraction=max_bad_fraction)
    prompter, answerer = Scripted(chatml, regen, end, script), Scripted(chatml, regen, end, answers)
    turns = [user_turn(chatml, None, "t")]
    (tmp_path / "work").mkdir(parents=True, exist_ok=True)
    excluded = {"excluded prompt"}

    def write_chunk(index):
        return synthesize_chunk(index, prompter, answerer, turns, synth, 0, excluded)

    def judge(counts):
        check_answers(counts, regen, chatml, "the-target")

    return collect(tmp_path / "work", write_chunk, synth, excluded, judge), prompter


def test_chunks_are_written_joined_without_duplicates_and_resumed(tmp_path, chatml):
    script = [["first request", None, "Second request", "excluded prompt"],
              ["first  REQUEST", "third request", "fourth request", "fifth request"]]
    answers = [["answer one", "answer two"], ["answer three", "answer four", "answer five", "answer six"]]
    (rows, stats), prompter = _collect(tmp_path, chatml, script, answers)
    assert [r["messages"][0]["content"] for r in rows] == ["first request", "Second request", "third request"]
    assert rows[0]["messages"][1] == {"role": "assistant", "content": "answer one"}
    assert stats["chunks"] == 2 and stats["tries"] == 8 and stats["conversations"] == 3
    # in chunk 0: one never ended, one repeats an evaluation prompt; joined: chunk 1's first repeats chunk 0's
    assert stats["dropped"] == {"truncated": 1, "evaluation": 1, "duplicate": 1}
    assert [n for n, _ in prompter.calls] == [4, 4] and prompter.calls[0][1] != prompter.calls[1][1]
    # a rerun reads the chunks back and writes nothing
    (again, again_stats), prompter = _collect(tmp_path, chatml, [], [])
    assert again == rows and again_stats["chunks_reused"] == 2 and prompter.calls == []


def test_a_target_that_writes_no_requests_is_refused_after_its_first_chunk(tmp_path, chatml):
    with pytest.raises(DataError, match="kept 0 of 4 requests") as error:
        _collect(tmp_path, chatml, [[None, None, "x", None]], [[]])
    assert "synthesize.system_prompts" in error.value.fix


def test_too_few_distinct_requests_are_refused(tmp_path, chatml):
    same = [["the same request"] * 4] * 20
    with pytest.raises(DataError, match="wrote 1 distinct usable conversations") as error:
        _collect(tmp_path, chatml, same, [["an answer"]] * 20, conversations=2, chunk_size=4)
    assert "synthesize.conversations" in error.value.fix


def test_a_target_that_writes_empty_answers_is_refused_naming_it(tmp_path, chatml):
    """Requests written, answers empty: the target is named (as regeneration names it), not the
    data prepare_dataset would later find empty; a rerun reading the chunks back judges them again."""
    from draftsmith.errors import TargetError

    script = [["first request", "second request", "third request", "fourth request"]]
    with pytest.raises(TargetError) as error:
        _collect(tmp_path, chatml, script, [["  ", "an answer", "", "\n"]], max_bad_fraction=0.5)
    assert "the target wrote 3 empty answers of 4 (75.0%), more than data.max_bad_fraction=0.5" in error.value.what
    assert "conversation 'self-0-0' (self:0), message 1" in error.value.what
    assert "the-target" in error.value.where and "regenerate.temperature" in error.value.fix
    with pytest.raises(TargetError, match="3 empty answers of 4"):
        _collect(tmp_path, chatml, [], [], max_bad_fraction=0.5)


def test_mostly_empty_answers_stop_before_the_last_chunk_and_a_few_are_a_warning(tmp_path, chatml, monkeypatch,
                                                                               caplog):
    from draftsmith.errors import TargetError
    from draftsmith.regenerate import answering

    monkeypatch.setattr(answering, "EARLY_JUDGE_ANSWERS", 4)
    script = [[f"request {i}" for i in range(4)], [f"request {i}" for i in range(4, 8)]]
    with pytest.raises(TargetError, match="3 empty answers of 4"):  # before chunk 1 is written
        _collect(tmp_path / "early", chatml, script, [["", "", "", "an answer"]], max_bad_fraction=0.5,
                 conversations=8)
    assert [p.name for p in (tmp_path / "early" / "work").glob("chunk-*")] == ["chunk-000000.json"]
    with caplog.at_level("WARNING", logger="draftsmith"):
        (rows, stats), _ = _collect(tmp_path / "few", chatml, script[:1], [["", "an answer", "another", "more"]])
    assert stats["empty_answers"] == 1 and len(rows) == 3
    assert "the target wrote 1 empty answers of 4 (25.0%); prepare_dataset drops their conversations" in caplog.text


def _run_stage(tmp_path, backend: str, **engine) -> tuple[list[dict], dict]:
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    out, stats = tmp_path / "synthesized.jsonl", tmp_path / "stats.json"
    result = synthesize_conversations(
        model, out, stats, tmp_path / "work", SynthesizeSettings(conversations=3, chunk_size=32, max_prompt_tokens=96,
                                                                 min_prompt_chars=1),
        RegenerateSettings(backend=backend, max_new_tokens=8, device="cpu", model_dtype="float32"), **engine)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result == json.loads(stats.read_text())
    return rows, result


def test_the_stage_with_a_tiny_model(tmp_path, one_thread):
    """A random-init target writes some requests that end within the limit: three are kept and answered,
    and prepare_dataset reads them as conversations."""
    from draftsmith.conversations import load_conversations

    rows, stats = _run_stage(tmp_path, "hf")
    assert len(rows) == 3 and stats["conversations"] == 3
    assert sum(stats["dropped"].values()) + 3 <= stats["tries"]
    read = list(load_conversations([tmp_path / "synthesized.jsonl"]))
    assert [[m["role"] for m in c.messages] for c in read] == [["user", "assistant"]] * 3
    assert len({c.messages[0]["content"] for c in read}) == 3


@vllm_test
def test_the_stage_in_vllm(tmp_path, in_process_engine):
    from tiny_vllm import ENGINE_ARGS

    rows, stats = _run_stage(tmp_path, "vllm", engine_kwargs=ENGINE_ARGS)
    assert len(rows) == 3 and Counter(m["role"] for r in rows for m in r["messages"]) == {"user": 3, "assistant": 3}
    assert Path(tmp_path / "work" / "fingerprint.json").is_file()


@pytest.mark.slow
def test_the_workflow_trains_on_what_the_target_wrote(tmp_path):
    """data.sources: [self] beside a file through Snakemake: preflight finds the user turn without
    loading weights, synthesize_conversations writes the conversations before regeneration answers
    the file's (one job at a time: so a GPU run's regeneration engine stays for capture),
    prepare_dataset splits both; a second plan reuses them."""
    from workflow_helpers import planned_jobs, planned_rules, snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config["data"].update(sources=["self", *config["data"]["sources"]], max_seq_len=192)
    config.update(synthesize={"conversations": 12, "chunk_size": 32, "max_prompt_tokens": 96, "min_prompt_chars": 1},
                  regenerate={"enabled": True, "max_new_tokens": 8}, train={"batch_tokens": 192},
                  vocab={"draft_vocab_size": 64})
    configfile = write_config(workdir, config)
    targets = ("results/t/preflight.json", "results/t/data/train.jsonl")
    jobs = planned_jobs(snakemake(workdir, "-n", *targets, configfile=configfile))
    assert jobs["synthesize_conversations"]["priority"] > jobs["regenerate_responses"]["priority"]
    snakemake(workdir, "--cores", "1", *targets, configfile=configfile)
    logs = workdir / "logs" / "t"
    synthesized, regenerated = ((logs / f"{rule}.log").read_text().splitlines()
                                for rule in ("synthesize_conversations", "regenerate_responses"))
    assert synthesized[-1][:23] <= regenerated[0][:23]  # their timestamps: one after the other
    results = workdir / "results" / "t"
    written = [json.loads(line) for line in (results / "data/synthesized.jsonl").read_text().splitlines()]
    assert len(written) == 12 and json.loads((results / "data/synthesized.stats.json").read_text())["conversations"] == 12
    preflight = json.loads((results / "preflight.json").read_text())
    assert preflight["self_written"]["user_turn_closes_with"] == "<|im_end|>"
    stats = json.loads((results / "data/stats.json").read_text())
    train = (results / "data/train.jsonl").read_text().splitlines()
    held_out = (results / "data/heldout.jsonl").read_text().splitlines()
    assert len(train) + len(held_out) == 12 + 40 and held_out, stats
    assert planned_rules(snakemake(workdir, "-n", *targets, configfile=configfile)) == set()
