"""Fixtures shared by several test modules: tiny tokenizers saved as Hugging Face folders, one CPU thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tiny


@pytest.fixture(scope="session", autouse=True)
def warm_engine_registry(tmp_path_factory):
    """Warm target engines that tests start (directly, or through a workflow's jobs, which inherit
    the variable) live in a registry of the session's own, and none outlives the session."""
    from draftsmith.engines import registry

    saved = os.environ.get(registry.ENGINE_DIR_ENV)
    os.environ[registry.ENGINE_DIR_ENV] = str(tmp_path_factory.mktemp("warm-engines"))
    yield
    for engine in registry.list_engines():
        registry.stop_engine(Path(engine["folder"]))
    if saved is None:
        os.environ.pop(registry.ENGINE_DIR_ENV, None)
    else:
        os.environ[registry.ENGINE_DIR_ENV] = saved


@pytest.fixture(scope="session", autouse=True)
def float32_on_every_cpu():
    """``auto`` runs the HF backend's batched forwards in bfloat16 on CPUs with bfloat16 matrix
    instructions: tests (and the workflows and scripts they start, which inherit the variable)
    compare paths in float32 on every machine, and ask for bfloat16 where they test it."""
    from draftsmith.engines.cpu_bfloat16 import CPU_BFLOAT16_ENV

    saved = os.environ.get(CPU_BFLOAT16_ENV)
    os.environ[CPU_BFLOAT16_ENV] = "0"
    yield
    if saved is None:
        os.environ.pop(CPU_BFLOAT16_ENV, None)
    else:
        os.environ[CPU_BFLOAT16_ENV] = saved


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Target descriptions the session's module fixtures inspect are kept in the session's own cache,
    never the user's (the tests' own cache below comes only after module fixtures)."""
    from draftsmith.targets.inspection_memo import CACHE_ENV

    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("session-cache"))
    yield
    if saved is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = saved


@pytest.fixture(autouse=True)
def own_inspection_memo(tmp_path_factory, monkeypatch):
    """Each test (and the workflows it starts) keeps target descriptions in a cache of its own, so
    one test's inspection never stands in for another's."""
    from draftsmith.targets.inspection_memo import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def chatml_tokenizer(tmp_path_factory) -> Path:
    """Folder of a tiny byte-level BPE tokenizer with a ChatML chat template (<|im_end|> closes turns)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("chatml_tokenizer"), tiny.CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_tokenizer(tmp_path_factory) -> Path:
    """Folder of a tiny tokenizer with a Llama-3 style chat template (BOS, <|eot_id|>, trimmed content)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("llama3_tokenizer"), tiny.LLAMA3_TEMPLATE)


@pytest.fixture(scope="session")
def chatml_tools_tokenizer(tmp_path_factory) -> Path:
    """A ChatML tokenizer whose template renders tools, tool calls and tool results (Qwen2.5's shape)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("chatml_tools_tokenizer"), tiny.CHATML_TOOLS_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_tools_tokenizer(tmp_path_factory) -> Path:
    """A Llama-3 tokenizer whose template renders tools, tool calls and ipython results (Llama 3.1's shape)."""
    return tiny.build_tokenizer(tmp_path_factory.mktemp("llama3_tools_tokenizer"), tiny.LLAMA3_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: synchronising threads costs more than the math, and on a busy machine
    spinning OpenMP threads slow them tenfold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def in_process_engine():
    """Run vLLM's engine and worker in this process while this module's engines live."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random-init Llama with a ChatML tokenizer."""
    return tiny.build_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    """A tiny multimodal wrapper (Llava) around a tiny Llama."""
    return tiny.build_llava(tmp_path_factory.mktemp("llava"))
