"""The online run's plan: its shards (extraction's plan of one part), the order the engine makes
them in (the order training reads them), and the window that order needs.

Everything here is derived from train.jsonl, target.json and the settings alone, identically in
the engine's process and in every training process: the engine never asks the trainer what to
make next, it follows the same plan.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from draftsmith.errors import ConfigError
from draftsmith.extract.extract import part_fingerprint, plan_part
from draftsmith.extract.hidden_states import HiddenStateIndex, ShardInfo, part_dir_name, shard_dir_name
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.settings import StageSettings, check_settings, from_schema
from draftsmith.train.batches import PREFETCH_AHEAD_STEPS, ShardMeta, Step, tokens_meta
from draftsmith.train.settings import TrainSettings

PART = 0  # online runs one engine: the window holds one part's shards


@dataclass(frozen=True)
class OnlineSettings(StageSettings):
    """The config's ``online`` section: the window's size and the share of shards kept for later epochs."""

    window_tokens: int = from_schema("online.window_tokens")
    cache_fraction: float = from_schema("online.cache_fraction")

    SECTION = "online"

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class Unit:
    """One stay of a shard in the window: made before step ``first`` reads it, deleted once step
    ``last`` is done. A shard read again later (the next epoch) is made again, unless cached."""

    shard: int
    first: int  # 0-based step
    last: int
    cached: bool


@dataclass
class OnlinePlan:
    window: Path
    shards: list[list[dict]]  # each shard's samples ({id, input_ids, loss_mask}), as extraction plans them
    index: HiddenStateIndex  # the shards as training reads them (root: the window)
    fingerprint: str  # what the states are made from: part_fingerprint and this package's code
    cached: frozenset[int]  # shards kept from their first epoch to their last use

    @classmethod
    def build(cls, train_jsonl: str | Path, target_info: dict, window: str | Path, extraction: ExtractionSettings,
              online: OnlineSettings) -> OnlinePlan:
        from draftsmith.fingerprint import code_fingerprint

        window = Path(window)
        shards = plan_part(train_jsonl, PART, 1, extraction)
        layer_ids = sorted(target_info["captured_layer_ids"])
        infos = [ShardInfo(part=PART, shard=n, path=f"{part_dir_name(PART)}/{shard_dir_name(n)}", num_samples=len(samples),
                           num_tokens=sum(len(s["input_ids"]) for s in samples),
                           num_loss_tokens=sum(sum(s["loss_mask"]) for s in samples))
                 for n, samples in enumerate(shards)]
        index = HiddenStateIndex(
            root=window, dtype=extraction.dtype, hidden_size=target_info["hidden_size"],
            aux_layer_ids=layer_ids[:-1], final_layer_id=layer_ids[-1], shards=infos,
            num_samples=sum(i.num_samples for i in infos), num_tokens=sum(i.num_tokens for i in infos),
            num_loss_tokens=sum(i.num_loss_tokens for i in infos))
        states = part_fingerprint(target_info, shards, extraction)
        fingerprint = hashlib.sha256(f"{states} {code_fingerprint('draftsmith.online')}".encode()).hexdigest()
        cached = frozenset(range(round(online.cache_fraction * len(shards))))
        return cls(window, shards, index, fingerprint, cached)

    @property
    def store_dir(self) -> Path:
        return self.window / part_dir_name(PART)

    @cached_property
    def shard_numbers(self) -> dict[str, int]:
        """Shard folder name -> shard number (``hidden_states.shard_dir_name``)."""
        return {shard_dir_name(n): n for n in range(len(self.shards))}

    def tokens(self, shard: int) -> int:
        return self.index.shards[shard].num_tokens

    def metas(self, settings: TrainSettings) -> list[ShardMeta]:
        """Each shard's training metadata from its samples: what ``shard_meta`` reads from a shard on disk."""
        metas = []
        for samples in self.shards:
            offsets = np.concatenate([[0], np.cumsum([len(s["input_ids"]) for s in samples])])
            mask = np.fromiter((m for s in samples for m in s["loss_mask"]), dtype=np.int64)
            metas.append(tokens_meta(offsets, mask, settings.batch_tokens, settings.ttt_steps, settings.loss_on))
        return metas

    def units(self, steps: list[Step]) -> list[Unit]:
        """The shards' stays in the window, in the order the engine makes them (the order of their
        first read). Every micro-batch of a step counts, the last step's fillers included. A stay
        runs from a shard's first read to its last within one mixed group of an epoch (the feed
        keeps the group's shards open) and across gaps the feed can read over (it builds batches up
        to ``PREFETCH_AHEAD_STEPS`` steps ahead): a copy made again inside either would never be read."""
        units: list[Unit] = []
        latest: dict[int, int] = {}  # shard -> its latest unit
        groups: dict[int, set[tuple[int, int]]] = {}  # unit -> the (epoch, group)s that read it
        for s, step in enumerate(steps):
            reads: dict[int, set[tuple[int, int]]] = {}
            for pack in step.packs:
                for shard in pack.shards:
                    reads.setdefault(shard, set()).add((step.epoch, pack.group))
            for shard in sorted(reads):
                k = latest.get(shard)
                if k is not None and (units[k].cached or units[k].last >= s - 1 - PREFETCH_AHEAD_STEPS
                                      or groups[k] & reads[shard]):
                    units[k] = replace(units[k], last=s)
                    groups[k] |= reads[shard]
                else:
                    latest[shard] = len(units)
                    groups[len(units)] = set(reads[shard])
                    units.append(Unit(shard, s, s, shard in self.cached))
        return units

    def window_needed(self, units: list[Unit], num_steps: int) -> int:
        """Tokens the window must hold: the most that are on disk at once. A stay is on disk from
        when the feed may first want it (``PREFETCH_AHEAD_STEPS`` before its first step, while
        earlier stays are still in use) until its last step is done."""
        change = np.zeros(num_steps + 1, dtype=np.int64)
        for u in units:
            if not u.cached:
                change[max(0, u.first - PREFETCH_AHEAD_STEPS)] += self.tokens(u.shard)
                change[u.last + 1] -= self.tokens(u.shard)
        return int(np.cumsum(change).max(initial=0))

    def check_window(self, units: list[Unit], num_steps: int, online: OnlineSettings,
                     extraction: ExtractionSettings) -> int:
        """Stop before any engine loads when the window cannot hold what one step reads."""
        needed = self.window_needed(units, num_steps)
        if needed > online.window_tokens:
            raise ConfigError(
                f"online.window_tokens is {online.window_tokens}, but training reads shards of {needed} "
                f"tokens at once (extraction.shard_tokens {extraction.shard_tokens}, train.mix_shards shuffled "
                "together), so the engine could never make the next shard", where="config key online.window_tokens",
                fix=f"set online.window_tokens to at least {needed}, or lower extraction.shard_tokens or train.mix_shards")
        return needed
