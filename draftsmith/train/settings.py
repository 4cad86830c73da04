"""TrainSettings: the train section of the config (with the draft's shape, the seed and the device),
and the launch keys beside it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from draftsmith.settings import StageSettings, bad_setting, check_settings, config_value, from_schema

AUTO_WARMUP_MAX = 50  # train.warmup_steps: null warms up a twentieth of the run, at most this


@dataclass(frozen=True)
class TrainSettings(StageSettings):
    """Everything that decides the trained weights, plus how often to log and checkpoint.

    ``batch_tokens`` is per micro-batch (one process, one forward); an optimizer step takes
    ``world_size * grad_accum_steps`` micro-batches, so 2 processes x 1 and 1 process x 2
    train on the same global batches and give the same weights.
    """

    ttt_steps: int = from_schema("train.ttt_steps")
    ttt_decay: float = from_schema("train.ttt_decay")
    hard_label_weight: float = from_schema("train.hard_label_weight")
    loss_on: str = from_schema("train.loss_on")
    feature_noise: float = from_schema("train.feature_noise")
    epochs: float = from_schema("train.epochs")  # a fraction trains on the first part of the last epoch's batches
    max_steps: int | None = from_schema("train.max_steps")
    batch_tokens: int = from_schema("train.batch_tokens")
    mix_shards: int = from_schema("train.mix_shards")
    packing: str = from_schema("train.packing")
    grad_accum_steps: int = 1
    lr: float = from_schema("train.lr")
    warmup_steps: int | None = from_schema("train.warmup_steps")  # None: warmup_for's share of the run
    weight_decay: float = from_schema("train.weight_decay")
    max_grad_norm: float = from_schema("train.max_grad_norm")
    checkpoint_every: int = from_schema("train.checkpoint_every")
    keep_checkpoints: int = 2
    log_every: int = from_schema("train.log_every")
    seed: int = from_schema("seed")
    dtype: str = "auto"  # "auto" (bfloat16 autocast on GPU, float32 on CPU), "bfloat16", "float32"
    variant: str = from_schema("draft.variant")  # the draft's shape decides the weights: part of the math
    num_layers: int = from_schema("draft.num_layers")
    norm_before_residual: bool = True  # speculators' trainer default (and vLLM's default reading)
    train_lm_head: bool = from_schema("train.train_lm_head")
    attention: str = "auto"  # "flex" (GPU default) or "sdpa" (CPU default): same math
    compile: str = "auto"  # torch.compile the draft step: "auto" = on GPU
    verify_shards: bool = True
    progress: bool = True
    device: str = from_schema("device")  # "auto" (cuda when present), "cuda" or "cpu"

    def warmup_for(self, steps: int) -> int:
        """The warmup of a run of ``steps`` optimizer steps: ``warmup_steps``, or when it is None a
        twentieth of the run, at most ``AUTO_WARMUP_MAX`` steps (so a short run still reaches its
        learning rate, and a long one warms up as it always did)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(AUTO_WARMUP_MAX, max(1, steps // 20))

    SECTION = "train"
    NOT_SETTINGS = {**{key: "launch, not math: run_training's arguments (launch_from_config)"
                       for key in ("devices", "nodes", "rdzv_port")},
                    "mode": "which rule trains (train_draft or train_draft_online), not math: the same draft either way"}

    # how often to checkpoint and the rendezvous port change no output: a change reruns nothing
    UNTRACKED = ("train.checkpoint_every", "train.rdzv_port")

    # settings that do not change the weights: a checkpoint stays valid when they change
    NON_MATH = ("checkpoint_every", "keep_checkpoints", "log_every", "verify_shards", "progress",
                "compile", "attention", "device")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the config keys against the schema, then the Python-only settings."""
        check_settings(self)
        choices = {"dtype": ("auto", "bfloat16", "float32"), "attention": ("auto", "flex", "sdpa"),
                   "compile": ("auto", "true", "false", True, False)}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise bad_setting(f"train.{key}", getattr(self, key), "one of " + ", ".join(map(repr, allowed)))
        for key in ("grad_accum_steps", "keep_checkpoints"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad_setting(f"train.{key}", getattr(self, key), "an integer >= 1")

    def math_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NON_MATH}


LAUNCH_KEYS = ("devices", "nodes", "rdzv_port")  # train: keys that decide the processes, not the math


def launch_from_config(config: Mapping) -> dict[str, int]:
    """``run_training``'s launch arguments (``devices``, ``nodes``, ``rdzv_port``) from the config's
    train section, beside ``TrainSettings.from_config``: they decide the processes, not the weights."""
    return {key: config_value(config, f"train.{key}") for key in LAUNCH_KEYS}
