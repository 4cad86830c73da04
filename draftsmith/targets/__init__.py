"""The target before any weight loads: what preflight learns and checks in seconds.

* ``inspect``       target.json: the model built on the meta device, its layers, tokenizer, fit on the devices
* ``identity``      the weights' fingerprint from sizes, times and headers, never their bytes
* ``vllm_support``  whether the installed vLLM can capture the target, read from vLLM's source text
* ``vllm_compat``   every rule that differs between the supported vLLM releases, in one place

The engines that load the weights are in ``draftsmith.engines`` and ``draftsmith.extract``.
"""
