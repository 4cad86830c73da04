"""The drafters the speculative loop runs: one protocol (``Drafter``), the prompt-lookup n-gram
baseline and the trained EAGLE-3 draft."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from draftsmith.evaluate.prompt_lookup import propose

log = logging.getLogger(__name__)


class Drafter(ABC):
    """Proposes draft tokens after the accepted text of one prompt at a time.

    Call order per prompt: ``begin`` once, then ``propose`` / ``commit`` alternately. The context is
    always the prompt and every accepted token; the target's aux states are known for all context
    positions but the last (the target has not run on the token it just chose).
    """

    needs_aux_states: bool = False

    @abstractmethod
    def begin(self, prompt_ids: list[int], first_token: int, aux_states: torch.Tensor | None) -> None:
        """A new prompt: the target prefilled ``prompt_ids`` (``aux_states`` [len(prompt), A*H]
        when ``needs_aux_states``) and chose ``first_token``."""

    @abstractmethod
    def propose(self, k: int) -> list[int]:
        """Up to ``k`` target token ids continuing the context (fewer, even none, is allowed)."""

    @abstractmethod
    def commit(self, new_tokens: list[int], aux_states: torch.Tensor | None) -> None:
        """The target accepted ``new_tokens[:-1]`` of the last proposal and chose ``new_tokens[-1]``;
        ``aux_states`` [len(new_tokens), A*H] are those of the positions of the previous last
        token and the accepted ones."""


class NgramDrafter(Drafter):
    """Prompt lookup as vLLM's ``ngram`` speculator runs it (``prompt_lookup.propose``): what followed
    the earliest earlier occurrence of the context's longest suffix of up to ``ngram_max`` tokens."""

    def __init__(self, ngram_max: int = 3) -> None:
        self.ngram_max = ngram_max
        self.context: list[int] = []

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]

    def propose(self, k: int) -> list[int]:
        return propose(self.context, k, ngram_max=self.ngram_max)

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


class Eagle3Drafter(Drafter):
    """The trained EAGLE-3 draft, run incrementally with its own KV cache.

    As in training (draftsmith.train): the target's aux state at position p is paired with the
    token at p+1 under position id p+1; the first draft token comes from the verified positions,
    each further one (TTT step j) from the draft's own output hidden state and the token it just
    proposed, at position id p+1+j, attending to the verified positions and to this chain's earlier
    steps. After each proposal the cache is cut back to the verified positions.
    """

    needs_aux_states = True

    def __init__(self, draft: torch.nn.Module) -> None:
        from draftsmith.draft.model import DraftKVCache

        self.draft = draft
        self.device = draft.fc.weight.device
        self._new_cache = lambda: DraftKVCache(len(draft.layers))
        self.cache = self._new_cache()
        self.pending: tuple[torch.Tensor, list[int]] | None = None
        self.next_position = 1  # position id of the first pending state (its token's position)

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.cache = self._new_cache()
        self.pending = (aux_states, [*prompt_ids[1:], first_token])
        self.next_position = 1

    def propose(self, k: int) -> list[int]:
        states, ids = self.pending
        n = len(ids)
        positions = torch.arange(self.next_position, self.next_position + n, device=self.device)
        hidden, logits = self.draft.draft_step(states.to(self.device), torch.tensor(ids, device=self.device),
                                               positions, self.cache)
        verified = len(self.cache)
        self.next_position += n
        self.pending = (states[:0], [])
        hidden = hidden[-1:]
        token = self.draft.draft_to_target(logits[-1:].argmax(-1))
        out = [int(token)]
        for j in range(1, k):
            position = torch.tensor([self.next_position - 1 + j], device=self.device)
            hidden, logits = self.draft.draft_step(hidden, token, position, self.cache, fused=True)
            token = self.draft.draft_to_target(logits.argmax(-1))
            out.append(int(token))
        self.cache.crop(verified)
        return out

    def commit(self, new_tokens, aux_states) -> None:
        self.pending = (aux_states, list(new_tokens))
