"""RegenerateSettings: the config's regenerate section and the target's engine."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.settings import StageSettings, check_settings, from_schema


@dataclass(frozen=True)
class RegenerateSettings(StageSettings):
    """The regenerate section of the config (``enabled`` is the workflow's switch, unused here), and
    the target's engine: its dtype, the device, vLLM's tensor parallel size and the sampling seed.
    Defaults and ranges from the schema."""

    enabled: bool = from_schema("regenerate.enabled")
    backend: str = from_schema("regenerate.backend")  # hf: transformers' generate; vllm: vLLM's engine
    max_new_tokens: int = from_schema("regenerate.max_new_tokens")
    temperature: float = from_schema("regenerate.temperature")
    top_p: float = from_schema("regenerate.top_p")
    batch_size: int = from_schema("regenerate.batch_size")
    chunk_size: int = from_schema("regenerate.chunk_size")  # conversations per resumable chunk
    enforce_eager: bool = from_schema("regenerate.enforce_eager")  # vLLM without CUDA graphs on a GPU
    seed: int = from_schema("seed")
    model_dtype: str = from_schema("target.dtype")  # dtype the target runs in; auto: engines.hf_model.model_dtype_name
    device: str = from_schema("device")
    tensor_parallel_size: int = from_schema("extraction.tensor_parallel_size")  # vLLM's; hf runs on one device
    max_bad_fraction: float = from_schema("data.max_bad_fraction")  # checked here, before the target loads

    SECTION = "regenerate"

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
