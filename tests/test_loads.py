"""Every load of the target is counted and timed in the job's log (draftsmith.engines.loads)."""

from __future__ import annotations

import logging
import re

import pytest

import tiny
from draftsmith.engines.hf_model import load_target_model
from draftsmith.engines.loads import target_load


def test_each_load_of_the_target_is_numbered_and_timed(tmp_path, caplog):
    model_dir = tiny.build_llama(tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="draftsmith.engines.loads"):
        load_target_model(model_dir, dtype="float32", device="cpu")
        load_target_model(model_dir, dtype="float32", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "draftsmith.engines.loads"]
    numbers = [int(re.match(r"target load (\d+) of this job: transformers \(float32 on cpu\) in [\d.]+ s", m).group(1))
               for m in lines]
    assert len(numbers) == 2 and numbers[1] == numbers[0] + 1


def test_a_failed_load_is_logged_and_raised(caplog):
    with caplog.at_level(logging.INFO, logger="draftsmith.engines.loads"), pytest.raises(RuntimeError):
        with target_load("vLLM serving engine, greedy (TP 8, CUDA graphs)"):
            raise RuntimeError("out of memory")
    assert re.search(r"target load \d+ \(vLLM serving engine, greedy \(TP 8, CUDA graphs\)\) failed after",
                     caplog.text)
