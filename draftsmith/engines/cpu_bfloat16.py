"""Whether this CPU multiplies bfloat16 natively (``target.dtype: auto`` on a CPU: engines.hf_model),
and ``DRAFTSMITH_CPU_BFLOAT16``, which overrides the probe. torch is imported by the probe alone, so
the config check reads the variable without it."""

from __future__ import annotations

import functools
import os

from draftsmith.errors import ConfigError

CPU_BFLOAT16_ENV = "DRAFTSMITH_CPU_BFLOAT16"


def forced_by_environment() -> bool | None:
    """``DRAFTSMITH_CPU_BFLOAT16``'s answer: 1 yes, 0 no, unset or empty: None (probe the CPU)."""
    value = os.environ.get(CPU_BFLOAT16_ENV)
    if not value:
        return None
    if value not in ("0", "1"):
        raise ConfigError(f"{CPU_BFLOAT16_ENV} is {value!r}, neither 1 nor 0", where="the environment",
                          fix=f"set {CPU_BFLOAT16_ENV} to 1 or 0, or unset it to probe the CPU (docs/cluster.md)")
    return value == "1"


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AMX tiles or AVX512-BF16), which oneDNN's
    bfloat16 matmuls use; without them bfloat16 is converted to float32 and runs slower.
    ``DRAFTSMITH_CPU_BFLOAT16`` (1 or 0) overrides the probe, so that the nodes of a cluster that
    differ resolve ``auto`` alike (each node's answer keys the stages' caches)."""
    forced = forced_by_environment()
    return _cpu_has_bfloat16_instructions() if forced is None else forced


@functools.cache
def _cpu_has_bfloat16_instructions() -> bool:
    import torch

    try:
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    except AttributeError:  # a torch build without these probes: assume none
        return False
