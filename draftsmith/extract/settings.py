"""ExtractionSettings: the config's extraction section, with the target's dtype and the device."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.extract.hidden_states import STORAGE_DTYPES
from draftsmith.settings import StageSettings, bad_setting, check_settings, from_schema


@dataclass(frozen=True)
class ExtractionSettings(StageSettings):
    """How to extract: the config's ``extraction`` section, the target's dtype and the device
    (``from_config``). Defaults and ranges of config keys come from the schema."""

    backend: str = from_schema("extraction.backend")
    parts: int = from_schema("extraction.parts")
    tensor_parallel_size: int = from_schema("extraction.tensor_parallel_size")
    dtype: str = from_schema("extraction.dtype")  # storage dtype of the states
    model_dtype: str = from_schema("target.dtype")  # dtype the target runs in; auto: engines.hf_model.model_dtype_name
    device: str = from_schema("device")
    device_map: str | None = from_schema("extraction.device_map")  # "auto" spreads the hf model over the GPUs
    batch_tokens: int = from_schema("extraction.batch_tokens")  # padded tokens per forward pass
    shard_tokens: int = from_schema("extraction.shard_tokens")  # tokens per shard, the unit of resume
    max_samples: int | None = None  # Python-only: the first samples of each part (tests, benchmarks)
    min_free_bytes: int = 1 << 30  # Python-only: disk space to leave free beyond the estimate
    max_model_len: int | None = from_schema("extraction.max_model_len")  # vLLM context; None = longest sample

    SECTION = "extraction"
    # How the target runs, not what it computes: the part's shards are keyed without them
    # (``part_fingerprint``), so a change would only rerun the part to reuse every shard, and retrain.
    UNTRACKED = ("extraction.batch_tokens", "extraction.max_model_len", "extraction.device_map")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.dtype not in STORAGE_DTYPES:
            raise bad_setting("extraction.dtype", self.dtype, "one of " + ", ".join(map(repr, STORAGE_DTYPES)))
        if self.max_samples is not None and (not isinstance(self.max_samples, int) or self.max_samples < 1):
            raise bad_setting("extraction.max_samples", self.max_samples, "a positive integer, or null")
        if not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise bad_setting("extraction.min_free_bytes", self.min_free_bytes, "an integer >= 0")
