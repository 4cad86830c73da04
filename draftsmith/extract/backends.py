"""The interface every hidden-state capture backend implements.
A backend loads the target once and turns batches of token ids into per-sample hidden states of
the captured layers (DESIGN.md's numbering: id i is the input of decoder layer i, id L the state
the lm_head consumes). Sorting, batching, sharding and writing belong to the extraction driver;
which backends suit a target is preflight's answer (``draftsmith.targets.vllm_support.backend_support``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from draftsmith.extract.hidden_states import CapturedRows


class CaptureBackend(ABC):
    """Loads the target once; ``capture`` maps token-id lists to {layer id: [len, hidden]} per sample."""

    name: str

    @abstractmethod
    def capture(self, batch: list[list[int]]) -> list[dict[int, CapturedRows]]:
        """Hidden states of the captured layers for each sequence of the batch, in batch order: tensors,
        or ``Fp8Rows`` where the backend quantises for an fp8 store on the target's device."""

    def close(self) -> None:
        """Release the model and any worker processes."""

    def __enter__(self) -> CaptureBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
