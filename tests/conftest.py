"""Fixtures shared by several test modules: tiny tokenizers saved as Hugging Face folders, one CPU thread."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny


@pytest.fixture(scope="session")
def chatml_tokenizer(tmp_path_factory) -> Path:
    """Folder of a tiny byte-level BPE tokenizer with a ChatML chat template (<|im_end|> closes turns)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("chatml_tokenizer"), tiny.CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_tokenizer(tmp_path_factory) -> Path:
    """Folder of a tiny tokenizer with a Llama-3 style chat template (BOS, <|eot_id|>, trimmed content)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("llama3_tokenizer"), tiny.LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: synchronising threads costs more than the math, and on a busy machine
    spinning OpenMP threads slow them tenfold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
