"""Stage evaluate_draft: speculative decoding of the held-out prompts with the target and a drafter,
checked token for token against the target's own greedy output.

The package, in the order an evaluation runs:

* ``settings``  EvalSettings, the drafters asked for (DrafterSpec), prompts, and what decoding returns
* ``drafters``  the Drafter protocol, the n-gram baseline, the EAGLE-3 draft
* ``decoding``  the speculative loop in transformers (HFDecoder), the target as a drafter
* ``metrics``   the lossless check, acceptance figures and speedup; the runs over prompts and drafters
* ``replay``    the loop's acceptance replayed on the target's greedy text (the k sweep; many drafts, one target run)
* ``vllm``      the draft served by vLLM as its speculator; a target evaluated in vLLM alone
* ``stage``     ``evaluate_draft``: the rule's entry point, acceptance.json

The loop is greedy chain drafting: each step the drafter proposes up to ``k`` tokens after the
text so far, the target scores the last accepted token and the proposals in one forward pass over
its KV cache, and the longest prefix of proposals equal to the target's own argmax choices is
accepted, plus the target's next choice. Speculative decoding is lossless, so the generated tokens
must equal plain greedy decoding; a difference raises ``EvaluationError``. Only a near-tie of the
target's two best logits, within the dtype's rounding, is let through: it is recorded, and the check
goes on against greedy decoding restarted after the speculative tokens, so every token is checked.

Drafters share one protocol (``Drafter``): the trained EAGLE-3 draft (fed the target's captured
aux hidden states of the accepted positions), the prompt-lookup n-gram baseline, and the target
itself as a perfect draft (for tests). Backends (``DecodingBackend``) run greedy and speculative
decoding; ``hf`` is Hugging Face transformers with KV caches. Metrics are computed here from what a
backend returns.

``eval.backend: vllm`` adds the deployment check: vLLM serves the target with the draft folder as
its EAGLE-3 speculator (``serve_with_vllm``, draftsmith.engines.vllm_serving), every output is
checked against the HF loop's greedy decoding with the same near-tie rule, and vLLM's own
acceptance counters go into acceptance.json under ``vllm``, beside the HF loop's figures for the
same draft and prompts. A target whose weights exceed one GPU cannot run in the HF loop; with
``eval.backend: vllm`` it is evaluated in vLLM alone (``evaluate_in_vllm``: vLLM's greedy decoding
as the reference, both drafters as vLLM speculators at ``k``).
"""

from draftsmith.evaluate.decoding import (
    DecodingBackend,
    HFDecoder,
    HFTarget,
    TargetDrafter,
    check_draft_fits,
    make_decoder,
)
from draftsmith.evaluate.drafters import Drafter, Eagle3Drafter, NgramDrafter
from draftsmith.evaluate.metrics import (
    ACCEPTANCE_FORMAT,
    MAX_LISTED_TIES,
    MIN_TIMED_PROMPTS,
    TIE_TOLERANCE,
    OutsideRun,
    acceptance_stats,
    check_lossless,
    run_evaluation,
)
from draftsmith.evaluate.settings import DRAFTER_KINDS, DrafterSpec, EvalSettings, Generation, Prompt, read_prompts
from draftsmith.evaluate.stage import evaluate_draft
from draftsmith.evaluate.vllm import (
    VllmRun,
    check_servable,
    evaluate_in_vllm,
    serve_with_vllm,
    vllm_outside_runs,
    vllm_section,
)

__all__ = [
    "ACCEPTANCE_FORMAT", "DRAFTER_KINDS", "MAX_LISTED_TIES", "MIN_TIMED_PROMPTS", "TIE_TOLERANCE", "acceptance_stats",
    "check_draft_fits", "check_lossless", "check_servable", "DecodingBackend", "Drafter", "DrafterSpec",
    "Eagle3Drafter", "EvalSettings", "evaluate_draft", "evaluate_in_vllm", "Generation", "HFDecoder", "HFTarget",
    "make_decoder", "NgramDrafter", "OutsideRun", "Prompt", "read_prompts", "run_evaluation", "serve_with_vllm",
    "TargetDrafter", "vllm_outside_runs", "vllm_section", "VllmRun",
]
