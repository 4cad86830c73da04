"""The worker side of the vLLM capture backend: forward hooks installed in every vLLM worker.

vLLM loads this class into its workers through ``worker_extension_cls`` (vLLM adds it to the
worker's bases); the driver calls its ``draftsmith_*`` methods with ``LLM.collective_rpc``, which
works the same whether the model runs in the driver process or in separate worker processes.

What the capture relies on is what every vLLM release and every model runner (the CPU runner,
the CUDA V1 runner, the newer CUDA GPU runner) share: the model's ``forward`` receives the step's
flattened ``input_ids`` and ``positions``, the decoder layers take ``(positions, hidden_states,
residual)``, and the top-level forward returns what the lm_head consumes. No runner bookkeeping
(input batches, request states, query offsets) is read: those differ between runners and releases.

Rows are matched to requests by content. The driver announces the prompts of a batch
(``draftsmith_expect``) and runs them with chunked prefill off, so each request's prompt lies
whole inside one forward pass, as one run of rows whose positions count 0, 1, 2, ...; a run whose
tokens equal an announced prompt is that prompt. Two announced prompts with the same tokens would
have the same states (a causal model's state depends only on the tokens up to it), so the driver
announces each distinct prompt once. A prompt computed twice (vLLM recomputes a preempted
request) is kept from its first run; a run matching no announced prompt (a warm-up or dummy batch)
is ignored.

Layer numbering (DESIGN.md, = Hugging Face ``output_hidden_states``): id ``i < L`` is the input of
decoder layer ``i``; id ``L`` is what the lm_head consumes. vLLM's decoder layers take and return
``(hidden_states, residual)`` with the residual add fused into the next norm, so the input of
layer ``i`` is ``hidden_states + residual`` as passed into it (``residual`` is None for layer 0).
A forward pre-hook on layer ``i`` computes that sum before the layer runs (the layer's fused norm
then updates both tensors in place). Hooks on the text model itself would not fire:
``@support_torch_compile`` replaces its ``__call__``; the backend runs vLLM eagerly
(``enforce_eager=True``) so that the hooks run as written.

Only TP rank 0 keeps states (every rank holds the full residual stream). Per forward pass it gathers
the captured rows of every hooked layer on the device (for an fp8 store, quantised there, per row,
by the store's own ``quantize_fp8``: half the bytes travel, and the driver does no quantising) and
copies them to pinned host memory on a side stream (the next pass computes meanwhile); a
background thread writes them as one raw file per pass (``read_pass`` says its layout) under the
driver's spool folder (``/dev/shm`` where it exists): hundreds of MB per batch
reach the driver through shared memory instead of the engine's RPC messages, which carry only where
each prompt's rows are. A pass's file appears under its final name only once complete (written
under a temporary name, then renamed), so ``draftsmith_collect`` answers as soon as the batch has
run and the driver waits for each file when it maps it: the engine starts the next batch while the
last passes of this one are still on their way to the spool.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draftsmith.extract.hidden_states import CapturedRows, Fp8Rows, quantize_fp8

log = logging.getLogger(__name__)

_SKIP_PREFIXES = ("vision", "visual", "audio", "mm_", "multi_modal", "image", "encoder")
_EMBEDDING_NAMES = ("embed_tokens", "embed_input_ids", "wte")
_HOST_BUFFERS = 3  # passes whose rows may be on their way to the spool at once
_PARTIAL = ".part"  # a pass file being written; renamed to its final name when complete
_FAILED = ".error"  # beside a pass file that could not be written: the reason


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
            beside_embedding = any(hasattr(parent, a) for a in _EMBEDDING_NAMES)
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


def prompt_runs(positions: list[int], token_ids: list[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """The runs of rows whose positions count up from 0: ``(first row, end row, their token ids)``."""
    runs, start = [], None
    for row, pos in enumerate(positions):
        if pos == 0:
            if start is not None:
                runs.append((start, row))
            start = row
        elif start is not None and pos != positions[row - 1] + 1:
            runs.append((start, row))
            start = None
    if start is not None:
        runs.append((start, len(positions)))
    return [(r0, r1, tuple(token_ids[r0:r1])) for r0, r1 in runs]


@dataclass
class _Pass:
    """One forward pass's captured rows on their way to the spool: the pass file's bytes."""

    path: str
    host: torch.Tensor  # the first bytes of ``buffer``
    done: torch.cuda.Event | None  # the device-to-host copy finished
    buffer: torch.Tensor  # the pinned host buffer (bytes), handed back to the free list once written


def pass_layout(info: dict[str, Any]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors a pass file holds, back to back: the states [layers, rows, hidden] in ``dtype``;
    for fp8 (``float8_e4m3fn``) their float32 scales [layers, rows] first, then the e4m3 values (the
    scales at the start keep their float32 view aligned whatever the row count)."""
    layers, rows, hidden = info["layers"], info["rows"], info["hidden"]
    dtype = getattr(torch, info["dtype"])
    if dtype == torch.float8_e4m3fn:
        return [(torch.float32, (layers, rows)), (dtype, (layers, rows, hidden))]
    return [(dtype, (layers, rows, hidden))]


def _byte_views(buffer: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of a byte buffer as the tensors of ``layout``, back to back from its start."""
    views, offset = [], 0
    for dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        views.append(buffer[offset:offset + size].view(dtype).view(shape))
        offset += size
    return views


def _layout_bytes(layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout)


class CaptureWorkerExtension:
    """Mixed into vLLM's worker class; every method the driver calls starts with ``draftsmith_``.
    Besides the capture hooks, ``draftsmith_load_draft`` loads a trained draft into the engine's
    speculator slot (draftsmith.engines.shared)."""

    def draftsmith_load_draft(self, folder: str) -> dict[str, Any]:
        """Load ``folder``'s model.safetensors (speculators format) into this worker's draft model in
        place, as vLLM reloads a model's weights (``model_loader.reload``): through the model's own
        ``load_weights`` (its names, its tensor-parallel split), then the platform's processing of
        each layer (the CPU build repacks linear weights), copied into the tensors the engine
        already holds, so its CUDA graphs stay valid."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_draft_model()
        if model is None:
            raise RuntimeError("this engine runs no draft model to load weights into")
        tensors = load_file(os.path.join(folder, "model.safetensors"))
        target = {id(p) for p in self.model_runner.get_model().parameters()}  # vLLM shares by the module itself
        shared = [name for name, p in model.named_parameters() if id(p) in target]
        if shared:  # a draft tensor vLLM shares with the target: loading it would change the target
            raise RuntimeError(f"the draft model shares {shared} with the target; it cannot be loaded in place")
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(model, self.model_runner.vllm_config.speculative_config.draft_model_config)
        return {"tensors": len(tensors), "rank": self.rank}

    def draftsmith_install(self, layer_ids: list[int], spool_dir: str, layers_path: str | None = None,
                           max_rows: int = 0, fp8: bool = False) -> dict[str, Any]:
        """Hook the decoder layers for ``layer_ids`` (DESIGN numbering); returns what was resolved.
        ``max_rows`` is the most rows one forward pass holds (the engine's token budget); with
        ``fp8`` the passes carry the store's fp8 (values and per-row scales), quantised here."""
        model_config = self.model_runner.model_config
        model = self.model_runner.get_model()
        text_config = model_config.hf_text_config
        num_layers = int(text_config.num_hidden_layers)
        path, layers = find_layers(model, num_layers, layers_path)
        text_model = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        bad = [i for i in layer_ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range 0..{num_layers}")
        if any(type(m).__name__ == "PPMissingLayer" for m in layers):
            raise RuntimeError("pipeline parallelism is not supported by the capture hooks; use tensor parallelism")
        if model_config.dtype == torch.float16 and type(layers[0]).__module__.endswith(".deepseek_v2"):
            # deepseek_v2.py divides the residual stream by routed_scaling_factor in float16 (overflow guard)
            raise ValueError("DeepSeek-family layers rescale their hidden states in float16; use bfloat16")

        for h in getattr(self, "_ds_handles", []):
            h.remove()
        self._ds_layer_ids = list(layer_ids)
        self._ds_hidden = int(text_config.hidden_size)
        self._ds_dtype = torch.float8_e4m3fn if fp8 else model_config.dtype  # what the pass files carry
        self._ds_spool = spool_dir
        self._ds_keep = self.rank == 0  # every TP rank holds the same rows; one sends them
        self._ds_stalled = 0.0  # seconds forward passes waited for a free host buffer
        self._ds_reset_state()
        if self._ds_keep:
            self._ds_start_writer(max(int(max_rows), 1))

        forward = inspect.signature(model.forward)
        handles = [model.register_forward_pre_hook(self._ds_begin_pass(forward), with_kwargs=True)]
        embedding = next((getattr(text_model, n) for n in _EMBEDDING_NAMES
                          if isinstance(getattr(text_model, n, None), nn.Module)), None)
        if embedding is not None:  # multimodal runners embed the tokens first and pass input_ids=None
            handles.append(embedding.register_forward_pre_hook(self._ds_saw_token_ids))
        for lid in self._ds_layer_ids:
            if lid < num_layers:
                signature = inspect.signature(layers[lid].forward)
                handles.append(layers[lid].register_forward_pre_hook(self._ds_layer_hook(lid, signature),
                                                                     with_kwargs=True))
        handles.append(model.register_forward_hook(self._ds_end_pass(num_layers)))
        self._ds_handles = handles
        return {"layers_path": path, "text_model": type(text_model).__name__, "num_layers": num_layers,
                "hidden_size": self._ds_hidden, "dtype": str(model_config.dtype), "rank": self.rank,
                "runner": type(self.model_runner).__module__}

    def draftsmith_expect(self, prompts: list[list[int]]) -> None:
        """Announce the distinct prompts the next ``generate`` runs (index = position in the list)."""
        self._ds_reset_state()
        self._ds_expected = {tuple(p): n for n, p in enumerate(prompts)}

    def draftsmith_collect(self) -> dict[str, Any] | None:
        """Where each announced prompt's rows are (TP rank 0 only); the pass files may still be on
        their way to the spool (``read_pass`` waits for each).

        Returns ``{"passes": [{"file", "rows", "layers", "hidden", "dtype"}, ...] (by pass number),
        "found": [[pass number, first row, end row] or None, ...] (by prompt index), "error": str | None,
        "stalled_s": seconds the passes so far waited for a free host buffer}``.
        """
        if not self._ds_keep:
            self._ds_reset_state()
            return None
        out = {"passes": self._ds_passes, "found": [self._ds_found.get(n) for n in range(len(self._ds_expected))],
               "error": self._ds_error or self._ds_writer_error, "stalled_s": round(self._ds_stalled, 3)}
        self._ds_reset_state()
        return out

    def draftsmith_reset(self) -> None:
        """Forget the announced prompts and what was captured (e.g. after an aborted batch), once
        every queued pass has reached the spool (which the driver then empties)."""
        if getattr(self, "_ds_keep", False):
            self._ds_queue.join()
            self._ds_writer_error = None
        self._ds_reset_state()

    def _ds_reset_state(self) -> None:
        self._ds_expected: dict[tuple[int, ...], int] = {}
        self._ds_found: dict[int, list[int]] = {}
        self._ds_passes: list[dict[str, Any]] = []  # this batch's passes, by pass number
        self._ds_pass: list[tuple[int, int, int]] | None = None  # this pass's (prompt index, row0, row1)
        self._ds_rows: dict[int, torch.Tensor] = {}
        self._ds_token_ids: torch.Tensor | None = None
        self._ds_error: str | None = None

    # -- hooks ---------------------------------------------------------------------------------

    def _ds_saw_token_ids(self, module, args):
        if args and isinstance(args[0], torch.Tensor):
            self._ds_token_ids = args[0]

    def _ds_begin_pass(self, forward: inspect.Signature):
        def hook(module, args, kwargs):
            """A forward pass starts: find the announced prompts among its rows."""
            self._ds_pass = None
            if not self._ds_keep or not self._ds_expected:
                return
            bound = forward.bind_partial(*args, **kwargs).arguments
            token_ids = bound.get("input_ids")
            if token_ids is None:
                token_ids = self._ds_token_ids
            positions = bound.get("positions")
            if token_ids is None or positions is None:
                self._ds_error = ("the model's forward received no input_ids/positions "
                                  f"(arguments: {sorted(k for k, v in bound.items() if v is not None)})")
                return
            if positions.dim() == 2:  # M-RoPE: [3, rows]; text rows carry the same position thrice
                positions = positions[0]
            rows = min(len(positions), len(token_ids))
            found = []
            for row0, row1, tokens in prompt_runs(positions[:rows].tolist(), token_ids[:rows].tolist()):
                index = self._ds_expected.get(tokens)
                if index is not None and index not in self._ds_found:
                    found.append((index, row0, row1))
            self._ds_pass = found or None
            self._ds_rows = {}
            self._ds_token_ids = None
        return hook

    def _ds_layer_hook(self, lid: int, signature: inspect.Signature):
        def hook(module, args, kwargs):
            if self._ds_pass is not None:
                self._ds_rows[lid] = _layer_input(signature, args, kwargs)
        return hook

    def _ds_end_pass(self, num_layers: int):
        def hook(module, args, output):
            if self._ds_pass is None:
                return
            found, self._ds_pass = self._ds_pass, None
            if num_layers in self._ds_layer_ids:
                final = output[0] if isinstance(output, (tuple, list)) else output
                if not isinstance(final, torch.Tensor):
                    raise RuntimeError(f"{type(module).__name__} returned {type(final).__name__}, not the final "
                                       "hidden states (pipeline parallelism is not supported)")
                self._ds_rows[num_layers] = final
            self._ds_send(found)
        return hook

    def _ds_send(self, found: list[tuple[int, int, int]]) -> None:
        """Gather this pass's prompt rows of every layer and queue them for the spool."""
        rows = torch.cat([torch.arange(r0, r1) for _, r0, r1 in found])
        total = int(rows.numel())
        for lid in self._ds_layer_ids:
            tensor = self._ds_rows.get(lid)
            if tensor is not None and tensor.dim() == 3 and tensor.shape[0] == 1:
                # vLLM's Transformers backend (families without a vLLM model file) runs transformers'
                # own layers on a batch of one: [1, tokens, hidden]
                tensor = self._ds_rows[lid] = tensor[0]
            if tensor is None or tensor.dim() != 2 or tensor.shape[0] < int(rows.max()) + 1:
                shape = None if tensor is None else tuple(tensor.shape)
                # e.g. sequence-parallel MoE (expert parallelism with TP > 1) splits the rows across ranks
                self._ds_error = (f"layer {lid}: the hooked tensor has shape {shape}, where [tokens, hidden] "
                                  f"with at least {int(rows.max()) + 1} rows (one per scheduled token) was "
                                  "expected: this model's layers are not captured in vLLM (sequence-parallel "
                                  "MoE, enable_expert_parallel with tensor_parallel_size > 1, splits the rows "
                                  "across ranks); set extraction.backend: hf")
                return
        device = self._ds_rows[self._ds_layer_ids[0]].device
        pieces = self._ds_gather(rows.to(device))
        self._ds_rows = {}
        info = self._ds_pass_info(total, os.path.join(self._ds_spool, f"pass-{next(self._ds_serial)}.raw"))
        layout = pass_layout(info)
        waited = time.perf_counter()
        buffer = self._ds_free.get()  # blocks while every host buffer is still being written
        self._ds_stalled += time.perf_counter() - waited
        needed = _layout_bytes(layout)
        cuda = device.type == "cuda"
        if buffer.numel() < needed:
            buffer = torch.empty(needed, dtype=torch.uint8, pin_memory=cuda)
        done = None
        if cuda:  # the copies run beside the next pass, which the compute stream starts at once
            self._ds_copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._ds_copy_stream):
                for host, piece in zip(_byte_views(buffer, layout), pieces, strict=True):
                    host.copy_(piece, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            for piece in pieces:
                piece.record_stream(self._ds_copy_stream)  # its memory is not reused before the copy ends
        else:
            for host, piece in zip(_byte_views(buffer, layout), pieces, strict=True):
                host.copy_(piece)
        number = len(self._ds_passes)
        offset = 0
        for index, r0, r1 in found:
            self._ds_found[index] = [number, offset, offset + r1 - r0]
            offset += r1 - r0
        self._ds_queue.put(_Pass(info["file"], buffer[:needed], done, buffer))
        self._ds_passes.append(info)

    def _ds_pass_info(self, rows: int, path: str) -> dict[str, Any]:
        """What the driver needs to map a pass file of ``rows`` rows (``read_pass``)."""
        return {"file": path, "rows": rows, "layers": len(self._ds_layer_ids), "hidden": self._ds_hidden,
                "dtype": str(self._ds_dtype).removeprefix("torch.")}

    def _ds_gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The pass's prompt rows of every layer, on the device, as the pass file holds them
        (``pass_layout``): the states, or for fp8 their scales and e4m3 values, quantised a layer at
        a time into the pass's buffers (one float32 temporary of one layer's rows, not of all)."""
        selected = (self._ds_rows[lid].index_select(0, rows) for lid in self._ds_layer_ids)
        if self._ds_dtype != torch.float8_e4m3fn:
            return [torch.stack(list(selected))]
        shape = (len(self._ds_layer_ids), rows.numel())
        scales = torch.empty(shape, dtype=torch.float32, device=rows.device)
        values = torch.empty((*shape, self._ds_hidden), dtype=torch.float8_e4m3fn, device=rows.device)
        for layer, states in enumerate(selected):
            values[layer], scales[layer] = quantize_fp8(states)
        return [scales, values]

    # -- the spool writer ----------------------------------------------------------------------

    def _ds_start_writer(self, max_rows: int) -> None:
        if getattr(self, "_ds_queue", None) is not None:
            return
        self._ds_serial = itertools.count()  # pass file names, unique over the engine's life
        self._ds_writer_error: str | None = None
        self._ds_queue: queue.Queue[_Pass] = queue.Queue()
        self._ds_free: queue.Queue[torch.Tensor] = queue.Queue()
        pin = torch.cuda.is_available() and self.model_runner.device.type == "cuda"
        if pin:
            self._ds_copy_stream = torch.cuda.Stream(self.model_runner.device)
        size = _layout_bytes(pass_layout(self._ds_pass_info(max_rows, "")))
        for _ in range(_HOST_BUFFERS):
            self._ds_free.put(torch.empty(size, dtype=torch.uint8, pin_memory=pin))
        threading.Thread(target=self._ds_write_passes, name="draftsmith-spool", daemon=True).start()

    def _ds_write_passes(self) -> None:
        while True:
            item = self._ds_queue.get()
            try:
                if item.done is not None:
                    item.done.synchronize()
                with open(item.path + _PARTIAL, "wb") as f:
                    f.write(item.host.reshape(-1).view(torch.uint8).numpy())
                os.replace(item.path + _PARTIAL, item.path)
            except Exception as e:  # noqa: BLE001 - the driver reads it beside the pass, and in the next collect
                self._ds_writer_error = f"writing captured states to {self._ds_spool}: {type(e).__name__}: {e}"
                _leave_reason(item.path, self._ds_writer_error)
            finally:
                self._ds_free.put(item.buffer)
                self._ds_queue.task_done()


def _leave_reason(path: str, reason: str) -> None:
    """Put why a pass failed beside its name, whole (written aside, then renamed), after removing
    the partial pass to free its space. Never raises: the writer thread must live on to hand every
    buffer back and mark every pass done."""
    with contextlib.suppress(OSError):
        os.unlink(path + _PARTIAL)
    with contextlib.suppress(OSError):
        with open(path + _FAILED + _PARTIAL, "w", encoding="utf-8") as f:
            f.write(reason)
        os.replace(path + _FAILED + _PARTIAL, path + _FAILED)


def read_pass(info: dict[str, Any], timeout: float) -> CapturedRows:
    """A spooled pass as [layers, rows, hidden] states (``Fp8Rows`` for fp8: values and their scales),
    mapped from its file (``pass_layout``) once the worker has written it (within ``timeout``
    seconds); the file is then removed: the mapping keeps the memory until the last view of it is gone."""
    path = info["file"]
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(path + _FAILED):
            with open(path + _FAILED, encoding="utf-8") as f:
                raise OSError(f.read())
        if not os.path.isdir(os.path.dirname(path)):
            raise FileNotFoundError(f"the spool folder of {path} is gone")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s (the vLLM worker stopped writing)")
        time.sleep(0.001)
    layout = pass_layout(info)
    flat = torch.from_file(path, shared=True, size=_layout_bytes(layout), dtype=torch.uint8)
    os.unlink(path)
    views = _byte_views(flat, layout)
    if len(views) == 1:
        return views[0]
    scales, values = views  # pass_layout's order for fp8
    return Fp8Rows(values, scales)
