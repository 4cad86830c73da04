"""Capture hidden states with Hugging Face transformers, through the layer path preflight resolved.

Hooks, not ``output_hidden_states``: a forward pre-hook on decoder layer ``i`` takes layer id ``i``
(the layer's input), and a pre-hook on the ``lm_head`` takes the final id ``L`` (what the head
consumes). The last hook that fires stops the forward, so the head never runs (its logits over a
large vocabulary would cost time and memory) and, when the final state is not asked for, no layer
after the last needed one runs either. Only the asked layers are ever kept.

On CUDA, each batch's states are copied to pinned host memory on a side stream while the next
batch computes (``capture_stream`` keeps one batch in flight). For an fp8 store (``fp8=True``) the
states are quantised on the device they were computed on before that copy (``Fp8Rows``): half the
bytes cross to the host, and the driver's CPU does no quantising.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.engines.hf_model import load_hf_model
from draftsmith.errors import ExtractionError, out_of_memory_as
from draftsmith.extract.backends import CaptureBackend
from draftsmith.extract.hidden_states import CapturedRows, Fp8Rows, quantize_fp8
from draftsmith.targets.logits import apply_logit_transform
from draftsmith.targets.logits import describe as describe_logits

log = logging.getLogger(__name__)

TEACHER_TOLERANCE = 0.02  # of the largest logit: bf16 rounding is 0.4%; a missed scale or cap is tens of %


@torch.inference_mode()
def check_teacher_logits(model: nn.Module, head: nn.Module, transform: dict | None, ids: torch.Tensor) -> None:
    """Stop when the target's logits over ``ids`` [1, T] are not what training's teacher computes from
    the final state (its lm_head's weight, then ``transform``): a family that scales, caps or biases
    its logits in a way target.json does not know would train the draft against another distribution."""
    seen = {}
    handle = head.register_forward_pre_hook(lambda module, args: seen.setdefault("final", args[0]))
    try:
        logits = model(input_ids=ids).logits.float()
    finally:
        handle.remove()
    final = seen["final"].to(head.weight.device).float()
    teacher = apply_logit_transform(final @ head.weight.float().T, transform).to(logits.device)
    error = (teacher - logits).abs().max().item() / max(logits.abs().max().item(), 1e-6)
    if error > TEACHER_TOLERANCE:
        raise ExtractionError(
            f"the target's logits are not what training's teacher computes from its final state "
            f"({describe_logits(transform)}, over the lm_head's weight): they differ by {error:.0%} of the "
            f"largest logit on the first sample's {ids.shape[1]} tokens, so the draft would learn another distribution than the "
            f"target's (the {type(model).__name__} head may scale, cap or bias its logits in its own way)",
            where="target.json logit_transform (draftsmith.targets.logits.RULES)",
            fix="add the family's rule to draftsmith.targets.logits.RULES, read from its modeling code's "
                "forward after lm_head, then rerun inspect_target")


class _StopForward(Exception):
    """Raised by the last hook that is needed, to end the forward pass early."""


@dataclass
class _InFlight:
    """One launched batch: its states (on the model's devices, or pinned copies being filled)."""

    lengths: list[int]
    states: dict[int, CapturedRows]  # layer id -> [batch, padded_len, hidden]
    events: list  # CUDA events that mark the copies done; empty on CPU


class HfBackend(CaptureBackend):
    """Runs the target under transformers and captures layers by hooks (see the module docstring)."""

    name = "hf"

    def __init__(self, model: nn.Module, *, layers_path: str, capture_layer_ids: Sequence[int],
                 final_layer_id: int, lm_head_path: str | None = None, pad_token_id: int = 0,
                 fp8: bool = False, logit_transform: dict | None = None) -> None:
        self.model = model.eval()
        self.fp8 = fp8  # hand back Fp8Rows, quantised on the states' device
        try:
            layers = model.get_submodule(layers_path)
        except AttributeError as e:
            raise ExtractionError(f"the loaded model has no module {layers_path!r}", where="target.json layers_path",
                                  fix="rerun the inspect_target rule against this model") from e
        if len(layers) != final_layer_id:
            raise ExtractionError(f"{layers_path} holds {len(layers)} layers, target.json says {final_layer_id}",
                                  where="target.json", fix="rerun the inspect_target rule against this model")
        self.layer_ids = sorted(set(capture_layer_ids))
        bad = [i for i in self.layer_ids if not 0 <= i <= final_layer_id]
        if bad:
            raise ExtractionError(f"layer ids {bad} are out of range 0..{final_layer_id}", where="target.json")
        self.final_layer_id = final_layer_id
        self.pad_token_id = pad_token_id
        self._captured: dict[int, torch.Tensor] | None = None
        self._stop_at = self.layer_ids[-1]
        # (the lm_head, target.json's logit_transform) until the first batch has checked the teacher's formula
        self._logits_to_check: tuple[nn.Module, dict | None] | None = None
        self._hooks = []
        for layer_id in self.layer_ids:
            if layer_id < final_layer_id:
                module = layers[layer_id]
            else:
                module = model.get_submodule(lm_head_path) if lm_head_path else model.get_output_embeddings()
                if module is None:
                    raise ExtractionError("the model has no lm_head module to take the final state from",
                                          where="target.json lm_head_path",
                                          fix="rerun the inspect_target rule, or use extraction.backend: vllm")
                self._logits_to_check = (module, logit_transform)
            self._hooks.append(module.register_forward_pre_hook(self._hook(layer_id), with_kwargs=True))
        embed = model.get_input_embeddings()
        self.input_device = embed.weight.device if embed is not None else next(model.parameters()).device
        self.cuda = self.input_device.type == "cuda"
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    @classmethod
    def load(cls, model_path: str | Path, *, layers_path: str, capture_layer_ids: Sequence[int],
             final_layer_id: int, lm_head_path: str | None = None, dtype: str = "auto", device: str = "auto",
             device_map: str | None = None, trust_remote_code: bool = False, fp8: bool = False,
             logit_transform: dict | None = None) -> HfBackend:
        """Load the target from its folder and hook the captured layers; the first batch checks that
        training's teacher formula (``logit_transform``: target.json's) gives the target's logits."""
        model = load_hf_model(model_path, dtype=dtype, device=device, device_map=device_map,
                              trust_remote_code=trust_remote_code)
        log.info("hf backend: %s loaded (%s, first layer on %s); capturing layers %s%s",
                 type(model).__name__, next(model.parameters()).dtype,
                 model.get_input_embeddings().weight.device, capture_layer_ids,
                 " as fp8, quantised on the device" if fp8 else "")
        return cls(model, layers_path=layers_path, capture_layer_ids=capture_layer_ids,
                   final_layer_id=final_layer_id, lm_head_path=lm_head_path, fp8=fp8, logit_transform=logit_transform)

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            if self._captured is None:  # the model called outside capture: stay out of the way
                return None
            if args:
                states = args[0]
            else:
                states = kwargs.get("hidden_states", kwargs.get("input"))
            self._captured[layer_id] = states
            if layer_id == self._stop_at:
                raise _StopForward
            return None
        return hook

    def capture(self, batch: list[list[int]]) -> list[dict[int, CapturedRows]]:
        return next(self.capture_stream([batch]))

    def capture_stream(self, batches: Iterable[list[list[int]]]) -> Iterator[list[dict[int, CapturedRows]]]:
        """``capture`` for a stream of batches, in order; on CUDA the next batch computes while the
        previous one's states travel to host memory."""
        pending = None
        for batch in batches:
            launched = self._launch(batch)
            if pending is not None:
                yield self._collect(pending)
            pending = launched
        if pending is not None:
            yield self._collect(pending)

    @torch.inference_mode()
    def _launch(self, batch: list[list[int]]) -> _InFlight:
        lengths = [len(ids) for ids in batch]
        if not batch or min(lengths) == 0:
            raise ExtractionError("a batch is empty or holds an empty sequence",
                                  fix="drop empty samples from train.jsonl")
        # Right padding: with a causal mask, real tokens never see the pads after them.
        input_ids = torch.full((len(batch), max(lengths)), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):
            input_ids[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
            attention_mask[row, :len(ids)] = 1
        if self.cuda:
            input_ids = input_ids.pin_memory().to(self.input_device, non_blocking=True)
            attention_mask = attention_mask.pin_memory().to(self.input_device, non_blocking=True)
        self._captured = {}
        where = f"a batch of {len(batch)} sequences, {input_ids.numel()} padded tokens"
        fix = ("lower extraction.batch_tokens (a sample longer than it is a batch of its own: lower "
               "data.max_seq_len then), or spread the target over more GPUs (extraction.device_map: auto) "
               "or use extraction.backend: vllm")
        try:
            with out_of_memory_as(ExtractionError, "the target's forward pass", where=where, fix=fix):
                self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            captured, self._captured = self._captured, None
        if self._logits_to_check is not None:  # once, on the batch's first sequence
            head, transform = self._logits_to_check
            self._logits_to_check = None
            with out_of_memory_as(ExtractionError, "the target's forward pass", where=where, fix=fix):
                check_teacher_logits(self.model, head, transform, input_ids[:1, :lengths[0]])
        missing = [i for i in self.layer_ids if i not in captured]
        if missing:
            what = "the lm_head was never called as a module" if self.final_layer_id in missing else \
                "their decoder layers were never called"
            raise ExtractionError(f"layers {missing} were not captured: {what}", where=type(self.model).__name__,
                                  fix="use extraction.backend: vllm for this architecture")
        for layer_id, states in captured.items():
            if states.shape[:2] != input_ids.shape:
                raise ExtractionError(
                    f"layer {layer_id} states have shape {tuple(states.shape)} for a batch of {tuple(input_ids.shape)}"
                    " tokens (the model keeps only some positions before its head?)",
                    where=type(self.model).__name__, fix="use extraction.backend: vllm for this architecture")
        if self.fp8:  # on each layer's own device (device_map), the whole padded batch at once
            with out_of_memory_as(ExtractionError, "quantising the batch's states to fp8", where=where, fix=fix):
                captured = {layer_id: Fp8Rows(*quantize_fp8(states)) for layer_id, states in captured.items()}
        if not self.cuda:
            return _InFlight(lengths, captured, [])
        return self._copy_to_host(lengths, captured)

    def _copy_to_host(self, lengths: list[int], captured: dict[int, CapturedRows]) -> _InFlight:
        """Start the device-to-host copies on a side stream; they overlap the next batch's compute."""
        host, events = {}, []
        for layer_id, states in captured.items():
            if isinstance(states, Fp8Rows):
                host[layer_id] = Fp8Rows(self._start_copy(states.values, events),
                                         self._start_copy(states.scales, events))
            else:
                host[layer_id] = self._start_copy(states, events)
        return _InFlight(lengths, host, events)

    def _start_copy(self, states: torch.Tensor, events: list) -> torch.Tensor:
        """A pinned host copy of ``states`` (filled on the device's side stream; the event that marks
        it done joins ``events``), or ``states`` itself where it is not on a CUDA device."""
        device = states.device
        if device.type != "cuda":
            return states
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        buffer = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            buffer.copy_(states, non_blocking=True)
            states.record_stream(stream)  # the allocator must not reuse it before the copy ran
            event = torch.cuda.Event()
            event.record(stream)
        events.append(event)
        return buffer

    def _collect(self, launched: _InFlight) -> list[dict[int, CapturedRows]]:
        for event in launched.events:
            event.synchronize()
        return [{layer_id: states[row, :length] for layer_id, states in launched.states.items()}
                for row, length in enumerate(launched.lengths)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
