"""Draft quality: the same hidden states through speculators 0.9's trainer and Draftsmith's, one evaluator.

Both trainers read the same store (Draftsmith's shards; speculators through ``StoreDataset``, a
``speculators.train.data.BaseDataset`` whose rows are the store's samples, fed to speculators' own
multipack sampler, collate function, ``shift_batch`` and ``Trainer``), train the same draft shape
(``Eagle3DraftConfig.from_target``: variant, layers, draft vocabulary, the target's embedding and
lm_head rows), for the same optimizer steps of the same batch tokens, with AdamW at the same lr,
weight decay and gradient clipping (1.0), linear warmup then linear decay to 0 over those steps,
and the same TTT steps and decay (recipe ``speculators-matched``). Recipe ``speculators-default``
is what ``speculators train`` does when told nothing but the data: Muon on the 2-D matrices beside
AdamW (both at lr, weight decay 0.1 and 0.01), warmup over 1% of the steps, TTT loss decay 1.0,
and for eagle3 its default norms (``norm_before_fc``, ``norm_output``); same steps and batch tokens.
Every draft is evaluated alike on the same held-out prompts: by default (``--evaluator replay``,
draftsmith.evaluate.replay) the target decodes each prompt greedily once and every draft's τ for
k = 1..``--max-k`` is replayed from one teacher-forced pass, the HF loop's figures without the
target per draft; ``--evaluator loop`` runs the HF loop itself (``evaluate_draft``, lossless-checked).

``--seeds``, ``--variants`` and ``--recipes`` run every combination in one process (kernels compile
once); each run's result is kept in its folder and a rerun skips it, so a job cut short by its time
limit (``--deadline``) goes on where it stopped. Printed: τ and acceptance by position per run and
the means over seeds, with Draftsmith's ratio to the better speculators recipe; ``--out`` gets the JSON.
A recipe ``draftsmith+key=value,...`` trains Draftsmith with those train settings changed.

On the GPU machine, after ``bench/gpu_pipeline.py`` has regenerated and extracted the demo's data
into ``--work`` (its FULL budget: answers up to 256 tokens; ``--storage bfloat16`` makes the store read here):

    python bench/trainer_quality.py --work /tmp/ds-work --seeds 0 1 2 --variants eagle3 eagle3.1 \
        --out /tmp/ds-out/trainer_quality.json

``--prompt-sets mt-bench=data/eval/mt_bench.jsonl humaneval=... gsm8k=...`` (``scripts/prompt_sets.py``'s
files, or any eval.sources file) evaluates every draft on each set too, reported on its own.

``--tiny`` builds its own inputs on the CPU in seconds (a random-init 4-layer Llama, prompts
answered by its own greedy decoding, the same extraction and vocabulary stages) and evaluates on
prompts of the training rows: a random target has no distribution to generalise over, so this
smoke mode compares how well each trainer fits, not how well it generalises.

Where the trainers differ by design (not by setting): speculators' loss is KL per TTT step averaged
over the micro-batch's loss tokens, Draftsmith's over the optimizer step's; speculators' shifted
TTT steps read the next packed sample's first tokens at a sample's end (masked from the loss, but
seen by attention), Draftsmith's stay within the sample; speculators' warmup starts at lr 0 (HF's
``get_linear_schedule_with_warmup``), Draftsmith's at lr/warmup. speculators' default fused loss
fails on torch 2.11, so it runs ``loss_implementation="eager"`` (same math).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract.hidden_states import HiddenStateIndex, read_shard  # noqa: E402

TRAIN_KEYS = ("num_layers", "ttt_steps", "ttt_decay", "hard_label_weight", "epochs", "batch_tokens", "lr", "warmup_steps", "weight_decay")
RECIPES = ("draftsmith", "speculators-matched", "speculators-default")
# speculators 0.9's default optimizer (speculators/train/config/schema.py): Muon on the 2-D matrices
# beside AdamW; the learning rates are the recipe's
SPECULATORS_DEFAULT_OPTIMIZER = {"optimizer": "muon", "weight_decay": 0.01, "muon_weight_decay": 0.1,
                                 "muon_momentum": 0.95, "muon_ns_steps": 5, "muon_adjust_lr_fn": "match_rms_adamw"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, help="gpu_pipeline.py's --work folder (target.json, vocab/, data/, stores)")
    p.add_argument("--store", default="hidden_states_bfloat16", help="the store folder inside --work")
    p.add_argument("--tiny", action="store_true", help="build tiny inputs in --work (a temporary folder if unset)")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    p.add_argument("--variants", nargs="+", default=["eagle3"], choices=["eagle3", "eagle3.1"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES),
                   help=f"of {', '.join(RECIPES)}, or draftsmith+key=value,... (train settings changed)")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--hard-label-weight", type=float, default=0.0)
    p.add_argument("--epochs", type=float, default=None, help="Draftsmith's epochs; speculators runs its steps (10; 40 tiny)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (8192; 256 tiny)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3; 3e-3 tiny)")
    p.add_argument("--warmup-steps", type=int, default=None, help="(20; 4 tiny)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts evaluated (all; 8 tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(128; 24 tiny)")
    p.add_argument("--k", type=int, default=3, help="the k reported first (and the loop evaluator's)")
    p.add_argument("--max-k", type=int, default=5, help="replay: tau for every k from 1 to this")
    p.add_argument("--evaluator", choices=["replay", "loop"], default="replay")
    p.add_argument("--trace-batch", type=int, default=32,
                   help="replay: prompts decoded greedily at once for the traces (1: one at a time, as the loop)")
    p.add_argument("--prompt-sets", nargs="+", default=[], metavar="NAME=PATH",
                   help="more prompt sets (eval.sources' files, e.g. scripts/prompt_sets.py's), rendered with the "
                        "target's chat template, each evaluated (replay) and reported on its own")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="a prompt set's longer prompts are left out")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which no new run starts (what is done is kept; rerun to go on)")
    p.add_argument("--phase", choices=["all", "train", "evaluate"], default="all",
                   help="train the drafts, or evaluate those a train phase left in --work")
    args = p.parse_args(argv)
    if not args.tiny and args.work is None:
        p.error("--work is required without --tiny")
    for recipe in args.recipes:
        if recipe not in RECIPES and not recipe.startswith("draftsmith+"):
            p.error(f"unknown recipe {recipe!r}")
    if args.max_k < args.k:
        p.error("--max-k must be at least --k")
    full = dict(device="cuda", epochs=10, batch_tokens=8192, lr=1e-3, warmup_steps=20, eval_prompts=None,
                max_new_tokens=128)
    tiny = dict(device="cpu", epochs=40, batch_tokens=256, lr=3e-3, warmup_steps=4, eval_prompts=8, max_new_tokens=24)
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------------------------
# Inputs


def tiny_inputs(work: Path, seed: int, num_rows: int = 48) -> dict:
    """A random-init Llama, rows of a random prompt answered by its own greedy decoding (regenerated
    data), extracted and mapped by the package's stage functions as the workflow runs them."""
    import numpy as np
    from transformers import LlamaForCausalLM

    from draftsmith.extract.extract import extract_part, merge
    from draftsmith.extract.settings import ExtractionSettings
    from draftsmith.targets.inspect import write_target_json
    from draftsmith.vocab import build_vocab_mapping
    from tests.tiny import build_llama, write_jsonl

    target = write_target_json(work / "target.json", build_llama(work / "target", num_layers=4, seed=seed))
    model = LlamaForCausalLM.from_pretrained(target["model_path"]).eval()
    rng = np.random.default_rng(seed)
    rows, prompts = [], []
    for i in range(num_rows):
        prompt = rng.integers(0, target["vocab_size"], size=int(rng.integers(3, 10))).tolist()
        answer = int(rng.integers(12, 40))
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=answer, min_new_tokens=answer,
                                 do_sample=False)[0].tolist()
        rows.append({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * answer})
        prompts.append({"id": f"r{i}", "messages": [], "prompt_ids": prompt})
    (work / "data").mkdir(parents=True, exist_ok=True)
    write_jsonl(work / "data" / "train.jsonl", rows)
    write_jsonl(work / "data" / "heldout.jsonl", prompts)
    settings = ExtractionSettings(backend="hf", dtype="float32", batch_tokens=2048, shard_tokens=1024,
                                  model_dtype="float32", device="cpu")
    store = work / "hidden_states_float32"
    extract_part(work / "data" / "train.jsonl", work / "target.json", 0, settings, store_root=store,
                 manifest_path=store / "part-0.json")
    merge([store / "part-0.json"], store / "index.json")
    build_vocab_mapping(work / "data" / "train.jsonl", target["vocab_size"], 256, work / "vocab" / "mapping.safetensors",
                        work / "vocab" / "stats.json")
    return inputs_in(work, store.name)


def inputs_in(work: Path, store: str) -> dict:
    paths = {"target": work / "target.json", "index": work / store / "index.json",
             "mapping": work / "vocab" / "mapping.safetensors", "heldout": work / "data" / "heldout.jsonl"}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise SystemExit(f"missing inputs {missing}: run bench/gpu_pipeline.py with --work {work} first")
    return paths


# ---------------------------------------------------------------------------------------------
# speculators' trainer on Draftsmith's store


@functools.cache  # one read of the store for every speculators run of the process (25 GB at 20,000 conversations)
def store_dataset(index_path: Path, dtype: torch.dtype):
    """speculators' ``BaseDataset`` over the store, read into memory once: a sample's aux states
    concatenated in ascending layer order, its token ids and loss mask, and the final state as
    ``verifier_last_hidden_states`` (stored after the target's final norm; the model's
    ``verifier_norm`` is an identity here). In memory, so that speculators' single-process loader
    does not read every sample's rows from disk each epoch (its own format has loader workers)."""
    from speculators.train.data import BaseDataset

    index = HiddenStateIndex.load(index_path)
    samples = []
    for shard in index.shards:
        data = read_shard(index, shard, verify=False)
        aux = torch.cat([data.states[i].to(dtype) for i in index.aux_layer_ids], -1)
        final = data.states[index.final_layer_id].to(dtype)
        offsets = data.offsets.tolist()
        samples += [{"hidden_states": aux[a:b], "input_ids": data.input_ids[a:b], "loss_mask": data.loss_mask[a:b],
                     "verifier_last_hidden_states": final[a:b]} for a, b in zip(offsets[:-1], offsets[1:])]

    class StoreDataset(BaseDataset):
        def __init__(self) -> None:
            super().__init__(max_len=10**9, hidden_states_dtype=dtype)

        def __len__(self) -> int:
            return len(samples)

        def _compute_approx_lengths(self) -> list[int]:
            return [len(x["input_ids"]) for x in samples]

        def _get_raw_data(self, i: int) -> dict:
            return {key: value.clone() for key, value in samples[i].items()}

    return StoreDataset()


def speculators_model(inputs: dict, args: argparse.Namespace, variant: str, recipe: str, seed: int, device: str):
    """speculators' Eagle3DraftModel of the shape Draftsmith trains, with the target's rows frozen in;
    the default recipe's eagle3 takes speculators' default norms."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import draft_rows
    from draftsmith.engines.weights import load_embedding_and_head
    from draftsmith.targets.inspect import read_target_json

    target = read_target_json(inputs["target"])
    mapping = load_file(str(inputs["mapping"]))
    ours = Eagle3DraftConfig.from_target(target, draft_vocab_size=int(mapping["d2t"].shape[0]), variant=variant,
                                         num_layers=args.num_layers, speculative_tokens=args.ttt_steps,
                                         aux_layer_ids=HiddenStateIndex.load(inputs["index"]).aux_layer_ids)
    if recipe == "speculators-default" and variant == "eagle3":
        ours = dataclasses.replace(ours, norm_before_fc=True, norm_output=True)
    config = Eagle3SpeculatorConfig.from_dict(ours.to_speculators())
    config.transformer_layer_config._attn_implementation = "simple_flex_attention" if device == "cuda" else "sdpa"
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(mapping["t2d"].bool(), mapping["d2t"].long())
    embed, head = load_embedding_and_head(inputs["target"])
    rows = draft_rows(mapping["d2t"], mapping["t2d"], ours.target_vocab_size)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.lm_head.weight.copy_(head[rows].float())
        model.verifier_lm_head.weight.copy_(head[rows].float())
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already normed
    return model


def step_bound_trainer():
    """speculators' Trainer, except that an epoch begun at max_steps does nothing: its ``train_epoch``
    checks max_steps only after a step, so each epoch left after it would run one step more."""
    from speculators.train.trainer import Trainer

    class StepBoundTrainer(Trainer):
        def train_epoch(self, epoch: int, **kwargs) -> None:
            if self.global_step < self.config.max_steps:
                super().train_epoch(epoch, **kwargs)

    return StepBoundTrainer


def speculators_recipe(recipe: str, args: argparse.Namespace, steps: int) -> dict:
    """The TrainerConfig fields and TTT loss decay of a speculators recipe: matched to Draftsmith's
    settings, or speculators 0.9's own defaults (speculators/train/config/schema.py) at these steps."""
    if recipe == "speculators-matched":
        return {"optimizer": "adamw", "weight_decay": args.weight_decay, "scheduler_warmup_steps": args.warmup_steps,
                "ttt_decay": args.ttt_decay}
    return {**SPECULATORS_DEFAULT_OPTIMIZER, "muon_lr": args.lr, "scheduler_warmup_steps": steps // 100,
            "ttt_decay": 1.0}


def train_speculators(inputs: dict, args: argparse.Namespace, variant: str, recipe: str, seed: int, steps: int,
                      out: Path, device: str) -> tuple[Path, int]:
    """speculators' Trainer for ``steps`` optimizer steps; returns the saved draft's folder and the steps run."""
    import speculators.train.trainer as trainer_module
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    StepBoundTrainer = step_bound_trainer()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = speculators_model(inputs, args, variant, recipe, seed, device)
    loader = _setup_dataloader(store_dataset(inputs["index"], dtype), args.batch_tokens,
                               model.config.transformer_layer_config.hidden_size, num_workers=0,
                               num_target_layers=len(model.target_layer_ids), prefetch_factor=None,
                               preprocess=shift_batch, seed=seed)
    # the sampler's batches per epoch vary with its shuffle: epochs enough, those past max_steps skipped
    epochs = math.ceil(steps / len(loader)) + 2
    chosen = speculators_recipe(recipe, args, steps)
    loss = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": chosen.pop("ttt_decay"),
            "loss_config": resolve_loss_config("kl_div", "eager")}
    config = trainer_module.TrainerConfig(
        lr=args.lr, num_epochs=epochs, save_path=str(out), train_call_kwargs=loss, val_call_kwargs=loss,
        scheduler_type="linear", scheduler_total_steps=steps, hidden_states_dtype=dtype, log_freq=10**9,
        max_steps=steps, **chosen)
    if device == "cpu":  # the Trainer moves the model to its local rank, a CUDA index, and times with
        trainer_module.get_local_rank = lambda: "cpu"  # accelerator syncs: neither exists on a CPU

        class UntimedStepTimer(trainer_module._StepTimer):
            def reset(self, enabled: bool) -> None:
                super().reset(False)

        trainer_module._StepTimer = UntimedStepTimer
    trainer = StepBoundTrainer(model, config, loader)
    trainer.run_training()
    return out / str(epochs - 1), trainer.global_step


# ---------------------------------------------------------------------------------------------
# Draftsmith's trainer


def recipe_overrides(recipe: str) -> dict:
    """``draftsmith+ttt_decay=1.0,warmup_steps=0`` -> {"ttt_decay": 1.0, "warmup_steps": 0} (YAML values)."""
    import yaml

    if "+" not in recipe:
        return {}
    pairs = [item.split("=", 1) for item in recipe.split("+", 1)[1].split(",")]
    return {key: yaml.safe_load(value) for key, value in pairs}


def train_draftsmith(inputs: dict, args: argparse.Namespace, variant: str, recipe: str, seed: int, out: Path,
                     device: str) -> dict:
    from draftsmith.train import TrainSettings, run_training

    values = {k: getattr(args, k) for k in TRAIN_KEYS}
    settings = TrainSettings(**{**values, "variant": variant, "seed": seed, "device": device, "progress": False,
                                "dtype": "bfloat16" if device == "cuda" else "float32",
                                "checkpoint_every": 10**6, "log_every": 10, **recipe_overrides(recipe)})
    return run_training(inputs["index"], inputs["mapping"], inputs["target"], out / "draft", out / "state", settings,
                        devices=1, metrics_out=out / "metrics.jsonl", summary_out=out / "summary.json")


# ---------------------------------------------------------------------------------------------
# The evaluation: every draft alike


@torch.no_grad()
def batched_greedy(target, prompts, length: int, batch_size: int) -> list[list[int]]:
    """Each prompt's first ``length`` greedy tokens, ``batch_size`` prompts of similar length at once
    (left-padded; one forward of the batch per token), past any stop token as ``trace_greedy`` decodes.
    One prompt at a time costs a forward per token per prompt: minutes for a few hundred prompts
    on the GPU, where a batch takes seconds. Padding can move a forward's last bits, so at a near-tie
    of two logits a token may differ from one-prompt decoding; every draft is replayed on the same
    traces, so the comparison stays like for like. For models that place rotary positions by
    ``position_ids`` (transformers' own families); remote code that counts them from the cache's
    length would see the padding: ``--trace-batch 1`` there."""
    model, device = target.model, target.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    decoded: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(len(prompts[i].ids) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for row, i in enumerate(rows):
            prompt = torch.tensor(prompts[i].ids, dtype=torch.long, device=device)
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = target.new_cache()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = []
        for step in range(length):
            tokens.append(logits.argmax(-1))
            if step + 1 < length:
                mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
                positions = positions[:, -1:] + 1
                logits = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=True).logits[:, -1]
        for prompt_index, continuation in zip(rows, torch.stack(tokens, dim=1).tolist()):
            decoded[prompt_index] = continuation
    return decoded


class Evaluator:
    """Evaluates drafts on the same held-out prompts: ``replay`` traces the target's greedy text once
    (``batched_greedy``; kept in ``work``, with the n-gram baseline's τ replayed by the HF loop's
    steps) and replays each draft for every k up to ``max_k``; ``loop`` runs ``evaluate_draft``
    (the HF loop, lossless-checked) per draft."""

    def __init__(self, inputs: dict, args: argparse.Namespace, work: Path) -> None:
        self.inputs, self.args, self.decoder = inputs, args, None
        if args.evaluator == "loop":
            return
        from draftsmith.evaluate import acceptance_stats, make_decoder, read_prompts
        from draftsmith.evaluate.drafters import NgramDrafter
        from draftsmith.evaluate.replay import replay_runs, trace_greedy
        from draftsmith.evaluate.settings import Generation
        from draftsmith.targets.inspect import read_target_json

        self.decoder = make_decoder(read_target_json(inputs["target"]), max_new_tokens=args.max_new_tokens,
                                    device=args.device)
        prompts = read_prompts(inputs["heldout"], args.eval_prompts)
        cache = work / f"traces-{len(prompts)}-{args.max_new_tokens}-{args.max_k}-b{args.trace_batch}.pt"
        if cache.is_file():
            saved = torch.load(cache, weights_only=False)
            self.traces, self.ngram = saved["traces"], saved["ngram"]
            return
        start = time.perf_counter()
        length = args.max_new_tokens + args.max_k + 1  # as trace_greedy decodes
        if args.trace_batch > 1:
            decoded = batched_greedy(self.decoder.target, prompts, length, args.trace_batch)
        else:
            decoded = None
        self.traces = trace_greedy(self.decoder, prompts, args.max_new_tokens, args.max_k, decoded)
        # the n-gram baseline's proposals depend on the greedy text alone: replayed by the HF loop's steps
        ngram_runs = replay_runs(self.decoder, prompts, {"ngram": NgramDrafter()}, [args.k],
                                 [Generation(t.prompt.id, t.ids[len(t.prompt.ids):], 0.0) for t in self.traces])
        self.ngram = acceptance_stats(ngram_runs["ngram", args.k], args.k)
        print(f"greedy traces and the n-gram baseline of {len(prompts)} prompts in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        torch.save({"traces": self.traces, "ngram": self.ngram}, cache)

    def __call__(self, draft: Path, out: Path) -> dict:
        if self.decoder is None:
            return self._loop(draft, out)
        from draftsmith.draft.speculators_format import load_speculators
        from draftsmith.evaluate import acceptance_stats
        from draftsmith.evaluate.replay import match_lengths, replay

        args, decoder = self.args, self.decoder
        model = load_speculators(draft, dtype=decoder.dtype, device=decoder.target.device).eval()
        lengths = [match_lengths(model, trace, args.max_k) for trace in self.traces]
        by_k = {}
        for k in range(1, args.max_k + 1):
            runs = [replay(t, n, k, args.max_new_tokens, decoder.stop_ids) for t, n in zip(self.traces, lengths)]
            by_k[k] = acceptance_stats(runs, k)
        main = by_k[args.k]
        return {"tau": main["tau"], "acceptance_rate_by_position": main["acceptance_rate_by_position"],
                "num_prompts": main["num_prompts"], "num_tokens": main["num_tokens"], "ngram_tau": self.ngram["tau"],
                "tau_by_k": {str(k): r["tau"] for k, r in by_k.items()},
                "acceptance_by_position_at_max_k": by_k[args.max_k]["acceptance_rate_by_position"]}

    def _loop(self, draft: Path, out: Path) -> dict:
        from draftsmith.evaluate import EvalSettings, evaluate_draft

        args = self.args
        settings = EvalSettings(backend="hf", k=args.k, k_sweep=(args.k,), max_prompts=args.eval_prompts or 10**6,
                                max_new_tokens=args.max_new_tokens, sweep_max_prompts=1, device=args.device)
        result = evaluate_draft(draft, self.inputs["target"], self.inputs["heldout"], out / "acceptance.json",
                                settings)
        return {"tau": result["tau"], "acceptance_rate_by_position": result["acceptance_rate_by_position"],
                "num_prompts": result["num_prompts"], "num_tokens": result["num_tokens"],
                "ngram_tau": result["baseline"]["tau"]}


# ---------------------------------------------------------------------------------------------
# The runs and the table


def prompt_set_evaluators(inputs: dict, args: argparse.Namespace, runs: Path) -> dict[str, Evaluator]:
    """An evaluator for each ``--prompt-sets`` file, rendered as prepare_eval_prompts renders an
    eval.sources set (the same prompt fields and chat template as the workflow's evaluation)."""
    from draftsmith.eval_prompts import EvalPromptsSettings, prepare_eval_prompts
    from draftsmith.targets.inspect import read_target_json

    if args.prompt_sets and args.evaluator != "replay":
        raise SystemExit("--prompt-sets takes the replay evaluator")
    model = read_target_json(inputs["target"])["model_path"]
    settings = EvalPromptsSettings(max_prompts=args.eval_prompts or 10**6, max_seq_len=args.max_prompt_tokens,
                                   max_bad_fraction=0.5)
    evaluators = {}
    for spec in args.prompt_sets:
        name, sep, path = spec.partition("=")
        if not sep or not name or name == "heldout":
            raise SystemExit(f"--prompt-sets {spec!r}: give NAME=PATH (a name other than heldout)")
        folder = runs / "prompt_sets" / name
        folder.mkdir(parents=True, exist_ok=True)
        rendered = folder / "prompts.jsonl"
        prepare_eval_prompts(path, model, rendered, settings)
        evaluators[name] = Evaluator({**inputs, "heldout": rendered}, args, folder)
    return evaluators


def run_one(inputs: dict, args: argparse.Namespace, runs: Path, variant: str, seed: int, recipe: str,
            evaluator: Evaluator | None, prompt_sets: dict[str, Evaluator] | None = None) -> dict | None:
    """Train (unless a trained draft is there) and evaluate one recipe; the result is kept in its
    folder (``result.json``), so a rerun returns it at once."""
    folder = runs / f"{variant}-{args.num_layers}" / f"seed-{seed}" / recipe
    result_file, trained_file = folder / "result.json", folder / "trained.json"
    if result_file.is_file():
        result = json.loads(result_file.read_text(encoding="utf-8"))
        if set(prompt_sets or ()) - set(result.get("sets", ())):  # a run kept from before: the new sets too
            result = _with_sets(result, prompt_sets, result_file)
        return result
    if trained_file.is_file():
        trained = json.loads(trained_file.read_text(encoding="utf-8"))
    elif args.phase == "evaluate":
        return None
    else:
        shutil.rmtree(folder, ignore_errors=True)  # a run cut short trains again from step 0
        start = time.perf_counter()
        if recipe.startswith("draftsmith"):
            summary = train_draftsmith(inputs, args, variant, recipe, seed, folder, args.device)
            trained = {"draft": str(folder / "draft"), "steps": summary["steps"], "tokens": summary["tokens"]}
        else:
            reference = run_one(inputs, args, runs, variant, seed, "draftsmith", None)  # its step count
            steps = reference["steps"]
            draft, done = train_speculators(inputs, args, variant, recipe, seed, steps, folder, args.device)
            trained = {"draft": str(draft), "steps": done, "tokens": None}
        trained["train_seconds"] = round(time.perf_counter() - start, 1)
        trained_file.write_text(json.dumps(trained, indent=2) + "\n", encoding="utf-8")
        print(f"{variant} seed {seed} {recipe}: trained, {trained['steps']} steps in {trained['train_seconds']} s",
              file=sys.stderr)
    if evaluator is None or args.phase == "train":
        return trained
    result = {**trained, "variant": variant, "seed": seed, "recipe": recipe, **evaluator(Path(trained["draft"]), folder)}
    result = _with_sets(result, prompt_sets or {}, result_file)
    print(f"{variant} seed {seed} {recipe}: tau {result['tau']:.3f}", file=sys.stderr)
    return result


def _with_sets(result: dict, prompt_sets: dict[str, Evaluator], result_file: Path) -> dict:
    """``result`` with each prompt set's evaluation it lacks, written to ``result_file``."""
    sets = dict(result.get("sets", {}))
    for name, evaluate in prompt_sets.items():
        if name not in sets:
            sets[name] = evaluate(Path(result["draft"]), result_file.parent)
    result = {**result, **({"sets": sets} if sets else {})}
    result_file.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def main(argv=None) -> dict:
    import tempfile

    args = parse_args(argv)
    started = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="trainer-quality-"))
    inputs = tiny_inputs(work, args.seeds[0]) if args.tiny else inputs_in(work, args.store)
    runs = work / "trainer_quality"
    runs.mkdir(parents=True, exist_ok=True)
    evaluator = Evaluator(inputs, args, runs) if args.phase != "train" else None
    prompt_sets = prompt_set_evaluators(inputs, args, runs) if evaluator is not None else {}
    results, skipped = [], []
    for variant in args.variants:  # a job cut short still leaves whole comparisons of the first variant
        for seed in args.seeds:
            for recipe in args.recipes:
                if args.deadline is not None and time.perf_counter() - started > args.deadline:
                    skipped.append(f"{variant} seed {seed} {recipe}")
                    continue
                result = run_one(inputs, args, runs, variant, seed, recipe, evaluator, prompt_sets)
                if result is not None and "tau" in result:
                    results.append(result)
    summary = {"settings": {k: getattr(args, k) for k in (*TRAIN_KEYS, "k", "max_k", "max_new_tokens", "device",
                                                          "evaluator", "eval_prompts")},
               "inputs": {k: str(v) for k, v in inputs.items()}, "runs": results, "not_run": skipped,
               "means": means(results),
               # each prompt set's means, over the runs that evaluated it (a run kept from before may not have)
               "prompt_sets": {name: means([{**r, **r["sets"][name]} for r in results if name in r.get("sets", {})])
                               for name in prompt_sets}}
    print_table(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def means(results: list[dict]) -> dict:
    """Per variant and recipe: τ and acceptance by position averaged over the seeds that ran, and
    Draftsmith's recipes' τ over the better speculators recipe's (over the seeds both ran)."""
    import numpy as np

    out: dict = {}
    for variant in sorted({r["variant"] for r in results}):
        rows = [r for r in results if r["variant"] == variant]
        table = {}
        for recipe in dict.fromkeys(r["recipe"] for r in rows):
            mine = [r for r in rows if r["recipe"] == recipe]
            table[recipe] = {"seeds": [r["seed"] for r in mine], "tau": float(np.mean([r["tau"] for r in mine])),
                             "tau_by_seed": [r["tau"] for r in mine],
                             "acceptance_rate_by_position": np.mean([r["acceptance_rate_by_position"] for r in mine],
                                                                    axis=0).tolist()}
            if "tau_by_k" in mine[0]:
                table[recipe]["tau_by_k"] = {k: float(np.mean([r["tau_by_k"][k] for r in mine]))
                                             for k in mine[0]["tau_by_k"]}
        theirs = [name for name in ("speculators-matched", "speculators-default") if name in table]
        for recipe in [name for name in table if name.startswith("draftsmith")]:
            for name in theirs:
                seeds = sorted(set(table[recipe]["seeds"]) & set(table[name]["seeds"]))
                if seeds:
                    tau = {r["recipe"] + str(r["seed"]): r["tau"] for r in rows if r["seed"] in seeds}
                    a = np.mean([tau[recipe + str(s)] for s in seeds])
                    b = np.mean([tau[name + str(s)] for s in seeds])
                    table[recipe][f"ratio_to_{name}"] = float(a / b)
        out[variant] = table
    return out


def print_table(summary: dict) -> None:
    s = summary["settings"]
    print(f"\n{s['epochs']} epochs of {s['batch_tokens']} batch tokens, {s['num_layers']} layer(s), TTT {s['ttt_steps']}, "
          f"lr {s['lr']}; k = {s['k']}; evaluator {s['evaluator']}")
    print(f"{'variant':<9} {'seed':>4} {'recipe':<34} {'tau':>6} {'accept by position':>22} {'train s':>8}")
    for r in summary["runs"]:
        by_pos = " ".join(f"{a:.3f}" for a in r["acceptance_rate_by_position"])
        print(f"{r['variant']:<9} {r['seed']:>4} {r['recipe']:<34} {r['tau']:>6.3f} {by_pos:>22} "
              f"{r['train_seconds']:>8.1f}")
    for variant, table in summary["means"].items():
        for recipe, m in table.items():
            ratios = " ".join(f"{k[9:]} {v:.3f}" for k, v in m.items() if k.startswith("ratio_to_"))
            by_pos = " ".join(f"{a:.3f}" for a in m["acceptance_rate_by_position"])
            print(f"mean {variant:<9} {recipe:<34} tau {m['tau']:.3f} ({len(m['seeds'])} seeds) [{by_pos}] {ratios}")
    if summary["runs"]:
        print(f"n-gram baseline tau {summary['runs'][0]['ngram_tau']:.3f}")
    for name, means_of_set in summary["prompt_sets"].items():
        for variant, table in means_of_set.items():
            for recipe, m in table.items():
                ratios = " ".join(f"{k[9:]} {v:.3f}" for k, v in m.items() if k.startswith("ratio_to_"))
                print(f"{name}: mean {variant:<9} {recipe:<34} tau {m['tau']:.3f} ({len(m['seeds'])} seeds) {ratios}")
        sample = next((r["sets"][name] for r in summary["runs"] if name in r.get("sets", {})), None)
        if sample:
            print(f"{name}: {sample['num_prompts']} prompts, n-gram baseline tau {sample['ngram_tau']:.3f}")
    if summary["not_run"]:
        print("not run (deadline): " + "; ".join(summary["not_run"]))


if __name__ == "__main__":
    main()
