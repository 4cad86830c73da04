"""Extraction: the target's hidden states captured into the shard store that training reads.

The package, in the order a part's states flow:

* ``settings``            ExtractionSettings (the config's extraction section, the target's dtype, the device)
* ``extract``             ``extract_part``: plan a part's shards, resume by shard, the part's manifest; ``merge``
* ``capture``             a part's batches through a capture backend, a writer thread beside the engine
* ``backends``            the interface every capture backend implements (CaptureBackend)
* ``hf_backend``          capture in transformers: pre-hooks on the decoder layers and the lm_head
* ``vllm_backend``        capture in vLLM: prefill-only requests at tensor parallelism
* ``vllm_worker``         the hooks vLLM loads into its workers
* ``shard_writer``        writing a part's shards: appended batch by batch, visible by rename once complete
* ``hidden_states``       the store's format (fp8's quantiser too): index, checksums, merging, reading shards and rows
* ``safetensors_stream``  safetensors files written front to back, hashed while written

Nothing is imported here: training and online training read the store (``hidden_states``,
``shard_writer``) without the capture engines, so their code fingerprints (and the caches those
key) do not change when a backend does.
"""
