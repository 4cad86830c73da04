"""The speculative loop in Hugging Face transformers: greedy and speculative decoding of one prompt
with KV caches for the target and the drafter (``HFDecoder``), and the target as a drafter."""

from __future__ import annotations

import logging
import platform
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from draftsmith.errors import EvaluationError
from draftsmith.evaluate.drafters import Drafter, Eagle3Drafter, NgramDrafter
from draftsmith.evaluate.settings import DrafterSpec, Generation, Prompt

log = logging.getLogger(__name__)


class DecodingBackend(ABC):
    """Runs the target greedily and speculatively; one instance holds one loaded target."""

    name: str
    stop_ids: list[int]
    max_new_tokens: int
    dtype: torch.dtype

    @abstractmethod
    def greedy(self, prompt: Prompt, max_new_tokens: int | None = None) -> Generation:
        """Plain greedy decoding."""

    @abstractmethod
    def logit_gap(self, prompt: Prompt, generated: list[int], token: int) -> tuple[float, float]:
        """After ``prompt`` + ``generated``: the target's best logit, and how far ``token``'s logit
        is below it (to tell a rounding near-tie from a bug)."""

    @abstractmethod
    def speculate(self, prompt: Prompt, drafter: DrafterSpec | Drafter, k: int,
                  max_new_tokens: int | None = None) -> Generation:
        """Speculative decoding with ``k`` draft tokens per verification step."""

    @abstractmethod
    def describe_device(self) -> dict:
        """What ran the evaluation (for acceptance.json)."""


class HFTarget:
    """A transformers causal LM under a KV cache, with forward pre-hooks on the aux layers that
    capture their inputs (layer id i = input of decoder layer i) during a forward that asks."""

    def __init__(self, model: torch.nn.Module, layers_path: str | None = None,
                 aux_layer_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._hooks = []
        if self.aux_layer_ids:
            layers = model.get_submodule(layers_path)
            for i in self.aux_layer_ids:
                self._hooks.append(layers[i].register_forward_pre_hook(partial(self._capture, i), with_kwargs=True))

    def _capture(self, layer_id: int, module, args, kwargs) -> None:
        if self._capturing:
            states = args[0] if args else kwargs["hidden_states"]
            self._captured[layer_id] = states[0]

    def new_cache(self, *, rewindable: bool = False):
        """A KV cache for the target (sliding-window layers kept whole); ``rewindable``: one that
        ``take_back`` can take rejected draft tokens back out of, at any length."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        _full_sliding_layers(cache)
        if rewindable:
            # A conv layer (LFM2's, linear attention's short convolution) keeps only its kernel's last
            # inputs, and transformers refuses to crop it; recording, it keeps every input until the
            # next crop, which then cuts exactly. Not for plain decoding: nothing would trim them.
            cache.activate_past_recording()
        return cache

    def snapshot(self, cache) -> list[torch.Tensor]:
        """Copies of ``cache``'s recurrent states, for ``take_back``."""
        return [state.clone() for state in _recurrent_states(cache)]

    def take_back(self, cache, fed: Sequence[int], keep: int, snapshot: list[torch.Tensor]) -> None:
        """Forget all but the first ``keep`` of the tokens ``fed`` to a rewindable ``cache`` since
        ``snapshot(cache)`` returned ``snapshot``."""
        if not snapshot or keep == len(fed):
            # Keys, values and recorded conv inputs crop exactly (crop(-0) too: it trims the conv inputs).
            _crop(cache, len(fed) - keep)
            return
        # A recurrent state cannot be cropped: back to the snapshot, before ``fed``, and run the kept
        # tokens again in one forward, as the verification ran them (a step with a rejection costs one
        # more forward of the target; transformers' assisted generation refuses such targets instead).
        _crop(cache, len(fed))
        for state, saved in zip(_recurrent_states(cache), snapshot, strict=True):
            state.copy_(saved)
        if keep:
            self.forward(fed[:keep], cache, last_only=True)
            _crop(cache, 0)

    @torch.no_grad()
    def forward(self, ids: Sequence[int], cache, *, last_only: bool,
                capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T or 1, V] of ``ids`` appended to ``cache``, and their aux states [T, A*H]
        (concatenated in ascending layer order) when ``capture``."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        self._captured.clear()
        self._capturing = capture
        try:
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        finally:
            self._capturing = False
        aux = None
        if capture:
            missing = [i for i in self.aux_layer_ids if i not in self._captured]
            if missing:
                raise EvaluationError(f"the target's forward did not run decoder layers {missing}",
                                      where="target.json layers_path / aux_layer_ids",
                                      fix="rerun inspect_target; set target.layers_path if it found the wrong layers")
            aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class TargetDrafter(Drafter):
    """The target as its own draft: proposes the target's greedy continuation, so every proposal
    is accepted (τ = k + 1); the check that the loop counts and verifies correctly."""

    def __init__(self, target: HFTarget) -> None:
        self.target = target
        self.context: list[int] = []
        self.cache = None
        self.cached = 0

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]
        self.cache = self.target.new_cache(rewindable=True)
        self.cached = 0

    def propose(self, k: int) -> list[int]:
        logits, _ = self.target.forward(self.context[self.cached:], self.cache, last_only=True)
        self.cached = len(self.context)
        snapshot = self.target.snapshot(self.cache)
        out = []
        for j in range(k):
            out.append(int(logits[-1].argmax()))
            if j < k - 1:
                logits, _ = self.target.forward(out[-1:], self.cache, last_only=True)
        self.target.take_back(self.cache, out[:-1], 0, snapshot)
        return out

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


def _full_sliding_layers(cache) -> None:
    """Swap a cache's sliding-window layers for full ones. A sliding layer keeps only the last
    window's keys, so once past the window it cannot be cropped back (transformers raises).
    A full layer keeps every key, and the model's own mask still applies the window (it reads
    the window from the config, not from the cache), so the outputs stay those of ``generate``.
    Only the plain sliding class is swapped: its subclasses and linear-attention hybrids carry
    state of their own that a full layer would drop."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer
                    for layer in cache.layers]


def _recurrent_states(cache) -> list[torch.Tensor]:
    """The recurrent states of a cache's linear-attention layers (Qwen3-Next's gated DeltaNet, Mamba):
    each folds every token it has seen into one matrix, so no crop can take a token back out."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [state for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
            for state in layer.recurrent_states.values() if state is not None]


def _crop(cache, n: int) -> None:
    """``cache.crop(-n)`` past the layers that cache nothing (Nemotron-H's MLP and MoE layers are
    empty linear-attention layers, on which transformers' crop fails)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin) or all(layer.is_conv_states_initialized.values()):
            layer.crop(-n)


def check_draft_fits(config, path: str | Path, aux_layer_ids: Sequence[int], vocab_size: int) -> None:
    """The draft (an ``Eagle3DraftConfig``) fuses the target's aux layers and speaks its vocabulary."""
    ids = list(config.aux_layer_ids)
    if ids != list(aux_layer_ids):
        raise EvaluationError(
            f"the draft fuses the target's layers {ids}, target.json says {list(aux_layer_ids)}",
            where=f"{path}/config.json eagle_aux_hidden_state_layer_ids",
            fix="evaluate the draft against the target it was trained for, or retrain it")
    if config.target_vocab_size != vocab_size:
        raise EvaluationError(f"the draft was built for a vocabulary of {config.target_vocab_size} "
                              f"tokens, the target has {vocab_size}", where=f"{path}/config.json",
                              fix="evaluate the draft against the target it was trained for")


class HFDecoder(DecodingBackend):
    """Greedy and speculative decoding with Hugging Face transformers, one prompt at a time."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, stop_ids: Sequence[int], max_new_tokens: int, *,
                 layers_path: str | None = None, aux_layer_ids: Sequence[int] = ()) -> None:
        self.target = HFTarget(model, layers_path, aux_layer_ids)
        self.stop_ids = list(stop_ids)
        self._stop = set(self.stop_ids)
        self.max_new_tokens = max_new_tokens
        self.dtype = next(model.parameters()).dtype
        self._drafters: dict[DrafterSpec, Drafter] = {}

    def drafter(self, spec: DrafterSpec | Drafter) -> Drafter:
        if isinstance(spec, Drafter):
            return spec
        if spec not in self._drafters:
            self._drafters[spec] = self._build_drafter(spec)
        return self._drafters[spec]

    def _build_drafter(self, spec: DrafterSpec) -> Drafter:
        if spec.kind == "ngram":
            return NgramDrafter(spec.ngram_max)
        if spec.kind == "target":
            return TargetDrafter(self.target)
        from draftsmith.draft.speculators_format import load_speculators

        draft = load_speculators(spec.path, dtype=self.dtype, device=self.target.device).eval()
        check_draft_fits(draft.config, spec.path, self.target.aux_layer_ids,
                         self.target.model.get_output_embeddings().weight.shape[0])
        return Eagle3Drafter(draft)

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def greedy(self, prompt: Prompt, max_new_tokens: int | None = None) -> Generation:
        limit = max_new_tokens or self.max_new_tokens
        self._sync()
        started = time.perf_counter()
        cache = self.target.new_cache()
        logits, _ = self.target.forward(prompt.ids, cache, last_only=True)
        tokens: list[int] = []
        while True:
            token = int(logits[-1].argmax())
            tokens.append(token)
            if token in self._stop or len(tokens) >= limit:
                break
            logits, _ = self.target.forward([token], cache, last_only=True)
        self._sync()
        return Generation(prompt.id, tokens, time.perf_counter() - started)

    def logit_gap(self, prompt: Prompt, generated: list[int], token: int) -> tuple[float, float]:
        logits, _ = self.target.forward([*prompt.ids, *generated], self.target.new_cache(), last_only=True)
        row = logits[-1].float()
        best = float(row.max())
        return best, best - float(row[token])

    def speculate(self, prompt: Prompt, drafter: DrafterSpec | Drafter, k: int,
                  max_new_tokens: int | None = None) -> Generation:
        limit = max_new_tokens or self.max_new_tokens
        drafter = self.drafter(drafter)
        capture = drafter.needs_aux_states
        self._sync()
        started = time.perf_counter()
        cache = self.target.new_cache(rewindable=True)
        logits, aux = self.target.forward(prompt.ids, cache, last_only=True, capture=capture)
        tokens = [int(logits[-1].argmax())]
        accepted: list[int] = []
        proposed: list[int] = []
        done = tokens[0] in self._stop or limit <= 1
        if not done:
            drafter.begin(list(prompt.ids), tokens[0], aux)
        while not done:
            draft = [int(t) for t in drafter.propose(k)][:k]
            fed = [tokens[-1], *draft]
            snapshot = self.target.snapshot(cache)
            logits, aux = self.target.forward(fed, cache, last_only=False, capture=capture)
            choice = logits.argmax(-1).tolist()
            a = 0
            while a < len(draft) and draft[a] == choice[a]:
                a += 1
            accepted.append(a)
            proposed.append(len(draft))
            self.target.take_back(cache, fed, a + 1, snapshot)  # the rejected proposals
            new = [*draft[:a], choice[a]]
            for token in new:
                tokens.append(token)
                if token in self._stop or len(tokens) >= limit:
                    done = True
                    break
            if not done:
                drafter.commit(new, aux[: a + 1] if aux is not None else None)
        self._sync()
        return Generation(prompt.id, tokens, time.perf_counter() - started, accepted, proposed)

    def describe_device(self) -> dict:
        import transformers

        device = self.target.device
        out = {"backend": self.name, "type": device.type, "dtype": str(self.dtype).replace("torch.", ""),
               "torch": torch.__version__, "transformers": transformers.__version__}
        if device.type == "cuda":
            out["name"] = torch.cuda.get_device_name(device)
        else:
            out["name"] = _cpu_name()
            out["threads"] = torch.get_num_threads()
        return out

    def close(self) -> None:
        self.target.close()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_decoder(target: dict, *, max_new_tokens: int, dtype: str = "auto", device: str = "auto") -> HFDecoder:
    """Load the target described by ``target`` (target.json) into the Hugging Face decoding loop."""
    from transformers import AutoTokenizer

    from draftsmith.engines.hf_model import load_target_model, stop_token_ids

    model = load_target_model(target["model_path"], dtype=dtype, device=device,
                              trust_remote_code=target.get("trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(target["model_path"],
                                              trust_remote_code=target.get("trust_remote_code", False))
    return HFDecoder(model, stop_token_ids(model, tokenizer), max_new_tokens,
                     layers_path=target["layers_path"], aux_layer_ids=target["aux_layer_ids"])
