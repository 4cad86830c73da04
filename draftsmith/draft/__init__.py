"""The EAGLE-3 draft, in three files (import from each: the config alone needs no torch, and the
preflight reads it):

* ``config``              Eagle3DraftConfig: shape, variant (eagle3, eagle3.1), speculators config.json
* ``model``               Eagle3Draft: the modules, the step shared by training and drafting, KV cache
* ``speculators_format``  save and load in the format speculators 0.9 and vLLM read
"""
