"""The worker side of the vLLM capture backend: forward hooks installed in every vLLM worker.

vLLM loads this class into its workers through ``worker_extension_cls`` (vLLM adds it to the
worker's bases); the driver calls its ``draftsmith_*`` methods with ``LLM.collective_rpc``, which
works the same whether the model runs in the driver process or in separate worker processes.

Layer numbering (DESIGN.md, = Hugging Face ``output_hidden_states``): id ``i < L`` is the input of
decoder layer ``i``; id ``L`` is what the lm_head consumes. vLLM's decoder layers take and return
``(hidden_states, residual)`` with the residual add fused into the next norm, so the input of
layer ``i`` is ``hidden_states + residual`` as passed into it (``residual`` is None for layer 0).
A forward pre-hook on layer ``i`` computes that sum before the layer runs (the layer's fused
norm then updates both tensors in place). Id ``L`` is the output of the top-level model's
forward: vLLM's model runner hands exactly that tensor to ``compute_logits`` (the lm_head). Hooks
on the text model itself would not fire: ``@support_torch_compile`` replaces its ``__call__``.

vLLM flattens the scheduled tokens of all requests into one batch. Rows are assigned to requests
from the model runner's own step state, read when the model's forward starts: the input batch's
``req_ids`` (row order), ``query_start_loc`` (row ranges) and ``num_computed_tokens`` (the position
of each range's first token, so a prompt prefilled in several chunks is stitched back exactly).
Each request carries its capture key in ``SamplingParams.extra_args``. Hooks record nothing
outside ``execute_model`` (profiling and warm-up runs use dummy batches), and the backend needs
``enforce_eager=True``: under torch.compile the hooks would be traced into the graph.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

CAPTURE_KEY = "draftsmith_capture"
_SKIP_PREFIXES = ("vision", "visual", "audio", "mm_", "multi_modal", "image", "encoder")


def find_layers(model: nn.Module, num_layers: int, layers_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """The decoder layers of the text model inside vLLM's module tree, through any wrapper.

    ``layers_path`` (e.g. from preflight) is tried first; Hugging Face and vLLM nest wrappers
    differently (HF ``model.language_model.layers``, vLLM ``language_model.model.layers``), so
    when it does not resolve here the ModuleList of ``num_layers`` modules that sits beside a token
    embedding (or else the shortest such path outside vision/audio towers) is used.
    """
    if layers_path:
        try:
            found = model.get_submodule(layers_path)
            if isinstance(found, nn.ModuleList) and len(found) == num_layers:
                return layers_path, found
        except AttributeError:
            pass
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and name.split(".")[-1] == "layers":
            if any(part.startswith(_SKIP_PREFIXES) for part in name.split(".")):
                continue
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            beside_embedding = any(hasattr(parent, a) for a in ("embed_tokens", "embed_input_ids", "wte"))
            candidates.append((not beside_embedding, name.count("."), name, module))
    if not candidates:
        raise RuntimeError(f"no ModuleList of {num_layers} decoder layers found in {type(model).__name__}; "
                           f"pass layers_path (the vLLM module path, e.g. language_model.model.layers)")
    candidates.sort(key=lambda c: c[:3])
    return candidates[0][2], candidates[0][3]


def _layer_input(signature: inspect.Signature, args: tuple, kwargs: dict) -> torch.Tensor:
    """HF-convention input of a vLLM decoder layer: ``hidden_states + residual`` as passed in."""
    bound = signature.bind_partial(*args, **kwargs).arguments
    hidden = bound.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError(f"decoder layer called without a hidden_states tensor (arguments: {list(bound)})")
    residual = bound.get("residual")
    if isinstance(residual, torch.Tensor):
        return hidden + residual  # a new tensor: later in-place updates of either do not reach it
    return hidden.clone()


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A CPU tensor as dtype name, shape and raw bytes (survives msgpack and pickle alike)."""
    t = t.detach().to("cpu").contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes()}


def decode_tensor(d: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`."""
    dtype = getattr(torch, d["dtype"])
    if not d["data"]:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype).reshape(d["shape"])


class _Capture:
    """One request's buffers: per layer a [prompt_len, hidden] tensor filled as its rows are computed."""

    __slots__ = ("token_ids", "row_ids", "states", "filled")

    def __init__(self, token_ids: list[int], num_layers: int, hidden: int, dtype: torch.dtype):
        self.token_ids = token_ids
        self.row_ids = torch.full((len(token_ids),), -1, dtype=torch.long)  # input ids of the rows captured
        self.states = [torch.empty(len(token_ids), hidden, dtype=dtype) for _ in range(num_layers)]
        self.filled = torch.zeros(num_layers, len(token_ids), dtype=torch.int32)


class CaptureWorkerExtension:
    """Mixed into vLLM's worker class; every method the driver calls starts with ``draftsmith_``."""

    def draftsmith_install(self, layer_ids: list[int], layers_path: str | None = None) -> dict[str, Any]:
        """Hook the decoder layers for ``layer_ids`` (DESIGN numbering); returns what was resolved."""
        runner = self.model_runner
        model = runner.get_model()
        text_config = runner.model_config.hf_text_config
        num_layers = int(text_config.num_hidden_layers)
        path, layers = find_layers(model, num_layers, layers_path)
        text_model = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        bad = [i for i in layer_ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range 0..{num_layers}")
        if any(type(m).__name__ == "PPMissingLayer" for m in layers):
            raise RuntimeError("pipeline parallelism is not supported by the capture hooks; use tensor parallelism")
        if runner.model_config.dtype == torch.float16 and type(layers[0]).__module__.endswith(".deepseek_v2"):
            # deepseek_v2.py divides the residual stream by routed_scaling_factor in float16 (overflow guard)
            raise ValueError("DeepSeek-family layers rescale their hidden states in float16; use bfloat16")

        self._ds_layer_ids = list(layer_ids)
        self._ds_slot = {lid: k for k, lid in enumerate(self._ds_layer_ids)}
        self._ds_captures: dict[str, _Capture] = {}
        self._ds_step: list[tuple[str, int, int, int]] | None = None  # (key, row0, row1, pos0)
        self._ds_active = False
        self._ds_error: str | None = None
        self._ds_dtype = runner.model_config.dtype
        self._ds_hidden = int(text_config.hidden_size)
        handles = getattr(self, "_ds_handles", [])
        for h in handles:
            h.remove()
        handles = [model.register_forward_pre_hook(self._ds_begin_forward)]
        for lid in self._ds_layer_ids:
            if lid < num_layers:
                layer = layers[lid]
                sig = inspect.signature(layer.forward)
                handles.append(layer.register_forward_pre_hook(self._ds_layer_hook(lid, sig), with_kwargs=True))
            else:
                handles.append(model.register_forward_hook(self._ds_final_hook(lid)))
        self._ds_handles = handles

        if not getattr(self, "_ds_wrapped", False):  # only real steps are captured, not dummy runs
            original = runner.execute_model

            def execute_model(*args, **kwargs):
                self._ds_active = True
                try:
                    return original(*args, **kwargs)
                finally:
                    self._ds_active = False
                    self._ds_step = None

            runner.execute_model = execute_model
            self._ds_wrapped = True
        return {"layers_path": path, "text_model": type(text_model).__name__, "num_layers": num_layers,
                "hidden_size": self._ds_hidden, "dtype": str(self._ds_dtype), "rank": self.rank}

    # -- hooks ---------------------------------------------------------------------------------

    def _ds_begin_forward(self, module, args):
        """Model forward starts: record which rows belong to which capture request in this step."""
        self._ds_step = None
        if not self._ds_active:
            return
        runner = self.model_runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        input_ids = runner.input_ids.cpu  # the token ids of this step's rows, as the model receives them
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        step = []
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = runner.requests[req_id]
            extra = (state.sampling_params.extra_args or {}) if state.sampling_params is not None else {}
            key = extra.get(CAPTURE_KEY)
            if key is None:
                continue
            capture = self._ds_captures.get(key)
            if capture is None:
                capture = _Capture(list(state.prompt_token_ids or []), len(self._ds_layer_ids),
                                   self._ds_hidden, self._ds_dtype)
                self._ds_captures[key] = capture
            row0, row1, pos0 = qsl[i], qsl[i + 1], int(computed[i])
            # Only prompt positions are kept: a sampled token fed back (max_tokens > 1) is not captured.
            row1 = min(row1, row0 + max(0, len(capture.token_ids) - pos0))
            if row1 > row0:
                step.append((key, row0, row1, pos0))
                capture.row_ids[pos0:pos0 + row1 - row0] = input_ids[row0:row1]
        self._ds_step = step or None

    def _ds_store(self, lid: int, rows: torch.Tensor) -> None:
        slot = self._ds_slot[lid]
        last = max(row1 for _, _, row1, _ in self._ds_step)
        if rows.dim() != 2 or rows.shape[0] < last:
            # e.g. sequence-parallel MoE (expert parallelism with TP > 1) splits the rows across ranks
            self._ds_error = (f"layer {lid}: the hooked tensor has shape {tuple(rows.shape)}, not one row per "
                              f"scheduled token ({last}); sequence-parallel MoE (enable_expert_parallel with "
                              "tensor_parallel_size > 1) is not supported")
            return
        host = rows[:last].to("cpu")  # one device-to-host copy per layer and step (padding rows dropped)
        for key, row0, row1, pos0 in self._ds_step:
            capture = self._ds_captures[key]
            pos1 = pos0 + (row1 - row0)
            capture.states[slot][pos0:pos1].copy_(host[row0:row1])
            capture.filled[slot, pos0:pos1] += 1

    def _ds_layer_hook(self, lid: int, signature: inspect.Signature):
        def hook(module, args, kwargs):
            if self._ds_step is not None:
                self._ds_store(lid, _layer_input(signature, args, kwargs))
        return hook

    def _ds_final_hook(self, lid: int):
        def hook(module, args, output):
            if self._ds_step is None:
                return
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(hidden, torch.Tensor):
                raise RuntimeError(f"{type(module).__name__} returned {type(hidden).__name__}, not the final "
                                   "hidden states (pipeline parallelism is not supported)")
            self._ds_store(lid, hidden)
        return hook

    # -- results -------------------------------------------------------------------------------

    def draftsmith_collect(self, keys: list[str]) -> dict[str, Any] | None:
        """Hand over (and forget) the finished captures; only TP rank 0 sends data back.

        Returns ``{key: {"token_ids": [...], "states": encoded [layers, len, hidden], "error": str|None}}``.
        Tensors travel as raw bytes (:func:`encode_tensor`): the engine returns RPC results through
        msgpack without type information, so a tensor would arrive as a plain list.
        """
        out = {}
        if self._ds_error is not None:
            error, self._ds_error = self._ds_error, None
            for key in keys:
                self._ds_captures.pop(key, None)
            return {key: {"token_ids": None, "states": None, "error": error} for key in keys} if self.rank == 0 else None
        for key in keys:
            capture = self._ds_captures.pop(key, None)
            if capture is None:
                out[key] = {"token_ids": None, "states": None, "error": "no forward pass ran for this request"}
                continue
            missing = (capture.filled == 0).sum(dim=1).tolist()
            repeated = (capture.filled > 1).sum(dim=1).tolist()
            error = None
            if not torch.equal(capture.row_ids, torch.tensor(capture.token_ids, dtype=torch.long)):
                error = "the rows captured for this request hold other token ids than its prompt"
            elif any(missing) or any(repeated):
                error = "; ".join(
                    f"layer {lid}: {m} of {len(capture.token_ids)} positions never captured, {r} more than once"
                    for lid, m, r in zip(self._ds_layer_ids, missing, repeated) if m or r)
                error += " (prefix caching must be off; the layer's hook must fire in every forward)"
            out[key] = {"token_ids": capture.row_ids.tolist(), "states": encode_tensor(torch.stack(capture.states)),
                        "error": error}
        if self.rank != 0:
            return None
        return out

    def draftsmith_reset(self) -> int:
        """Drop every pending capture (e.g. after an aborted batch); returns how many were dropped."""
        n = len(getattr(self, "_ds_captures", {}))
        self._ds_captures = {}
        return n
