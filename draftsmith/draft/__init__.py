"""The EAGLE-3 draft, in three files:

* ``config``              Eagle3DraftConfig: shape, variant (eagle3, eagle3.1), speculators config.json
* ``model``               Eagle3Draft: the modules, the step shared by training and drafting, KV cache
* ``speculators_format``  save and load in the format speculators 0.9 and vLLM read
"""

from draftsmith.draft.config import VARIANTS, Eagle3DraftConfig
from draftsmith.draft.model import DraftKVCache, Eagle3Draft, draft_rows, num_flops_per_token
from draftsmith.draft.speculators_format import load_speculators, save_speculators, speculators_state_dict

__all__ = [
    "VARIANTS", "Eagle3DraftConfig", "Eagle3Draft", "DraftKVCache", "save_speculators", "load_speculators",
    "speculators_state_dict", "draft_rows", "num_flops_per_token",
]
