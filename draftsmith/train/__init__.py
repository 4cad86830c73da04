"""Train an EAGLE-3 draft on captured hidden states, with training-time test (TTT).

The package, in the order a step's data flows:

* ``settings``     TrainSettings (the config's train section) and the launch keys split from it
* ``batches``      the run's plan from shard metadata, packed micro-batches read from the store, prefetch
* ``attention``    the attention pattern of the unrolled draft (flex on GPU, sdpa on CPU)
* ``objective``    the positions each TTT step scores, the KL to the teacher, the unrolled draft
* ``checkpoints``  checkpoints keyed by code, settings and inputs; resume
* ``distributed``  torchrun's process group
* ``metrics``      what a logging step reports (metrics.jsonl, TensorBoard, progress)
* ``loop``         ``train_draft``: build, resume, the step loop, the final save
* ``launch``       ``run_training``: this process or torchrun's (``python -m draftsmith.train``)

Conventions are speculators 0.9's (speculators/models/eagle3/{data,core,attention,metrics}.py),
so a draft trained here behaves under vLLM's eagle3 proposer as one trained there:

* shift (data.py ``shift_batch``): per sample of n tokens the draft sees n-1 positions t with
  token x[t+1], fused aux state g[t], teacher state y[t+1] (the target's distribution over
  x[t+2]), loss mask l[t+1] and position id t+1.
* TTT (core.py ``forward``): step j feeds back step j-1's output hidden state (pre-norm; post-norm
  with ``norm_output``, EAGLE 3.1) with the teacher-forced token x[t+1+j]
  (``original_input_ids[:, 1 + ttt_step:]``) at position id t+1+j; its logits at t are scored
  against the teacher at t+j under loss mask l[t+1+j] (metrics.py ``align_for_step``), weighted
  by ``ttt_decay**j``, each step's KL averaged over its loss tokens (losses/utils.py
  ``loss_function``) and the steps summed. ``train.hard_label_weight`` > 0 mixes into each
  position's KL the cross-entropy on the teacher's top token (not a speculators option);
  ``train.loss_on: all`` takes every position's l as 1, the prompts' too (nor this);
  ``train.feature_noise`` > 0 noises the fused aux states g[t] of training steps, relative to each
  state's scale (``objective.noised_states``; EAGLE's feature noise, not a speculators option).
* attention (attention.py ``create_combined_mask_mod``, ``extend_*_mask_for_draft_tokens``):
  step j's query at t sees step 0's keys causally within its sample plus the keys of steps 1..j
  at the same t.

Where speculators lets a shifted step read past the end of a packed sample (its right-padding
runs across document boundaries), positions whose step-j target lies outside the sample are
excluded here, so packing never changes the loss.

The teacher is the captured final state (post-norm, what the target's lm_head consumes) times
the lm_head rows of the draft vocabulary. The lm_head, the teacher and the loss touch only the
positions that carry a loss (gather indices built with the batch, on the host). The rest of the
target's vocabulary is touched only on logging steps, chunked, to learn whether the target's true
argmax lies in the draft vocabulary, so that the reported accuracy is the probability that vLLM
accepts the draft token; every step also counts agreement within the draft vocabulary.
"""

from draftsmith.train.batches import (
    PAD_MULTIPLE,
    BatchFeed,
    Pack,
    ShardMeta,
    Step,
    build_batch,
    dequantize_batch,
    plan_run,
    plan_steps,
    shard_meta,
)
from draftsmith.train.checkpoints import CHECKPOINT_FORMAT, FINISHED
from draftsmith.train.distributed import Dist, init_distributed
from draftsmith.train.launch import launch_command, main, run_training
from draftsmith.train.loop import train_draft, train_step
from draftsmith.train.metrics import summarize
from draftsmith.train.objective import DraftLoss, LossKernels, TTTObjective, scored_positions
from draftsmith.train.settings import LAUNCH_KEYS, TrainSettings, launch_from_config

__all__ = [
    "CHECKPOINT_FORMAT", "FINISHED", "LAUNCH_KEYS", "PAD_MULTIPLE", "BatchFeed", "Dist", "DraftLoss", "LossKernels",
    "Pack", "ShardMeta", "Step", "TTTObjective", "TrainSettings", "build_batch", "dequantize_batch",
    "init_distributed", "launch_command", "launch_from_config", "main", "plan_run", "plan_steps", "run_training",
    "scored_positions", "shard_meta", "summarize", "train_draft", "train_step",
]
