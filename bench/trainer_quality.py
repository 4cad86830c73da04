"""Draft quality: the same hidden states through speculators 0.9's trainer and Draftsmith's, one evaluator.

Both trainers read the same store (Draftsmith's shards; speculators through ``StoreDataset``, a
``speculators.train.data.BaseDataset`` whose rows are the store's samples, fed to speculators' own
multipack sampler, collate function, ``shift_batch`` and ``Trainer``), train the same draft shape
(``Eagle3DraftConfig.from_target``: variant, layers, draft vocabulary, the target's embedding and
lm_head rows), for the same optimizer steps of the same batch tokens, with AdamW at the same lr,
weight decay and gradient clipping (1.0), linear warmup then linear decay to 0 over those steps,
and the same TTT steps and decay. Both drafts are then evaluated by ``draftsmith.evaluate`` (the
HF speculative loop, greedy, lossless-checked) on the same held-out prompts. Printed: τ and
acceptance by position side by side, and the ratio; ``--out`` gets the JSON.

On the GPU machine, after ``bench/gpu_pipeline.py`` has regenerated and extracted the demo's data
into ``--work`` (its FULL budget: answers up to 256 tokens; ``--storage bfloat16`` makes the store read here):

    python bench/trainer_quality.py --work /tmp/ds-work --out /tmp/ds-out/trainer_quality.json

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
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract.hidden_states import HiddenStateIndex, ShardRows, dequantize_fp8, read_shard  # noqa: E402

TRAIN_KEYS = ("variant", "num_layers", "ttt_steps", "ttt_decay", "epochs", "batch_tokens", "lr", "warmup_steps",
              "weight_decay")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, help="gpu_pipeline.py's --work folder (target.json, vocab/, data/, stores)")
    p.add_argument("--store", default="hidden_states_bfloat16", help="the store folder inside --work")
    p.add_argument("--tiny", action="store_true", help="build tiny inputs in --work (a temporary folder if unset)")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    p.add_argument("--variant", default="eagle3", choices=["eagle3", "eagle3.1"])
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--epochs", type=float, default=None, help="Draftsmith's epochs; speculators runs its steps (10; 40 tiny)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (8192; 256 tiny)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3; 3e-3 tiny)")
    p.add_argument("--warmup-steps", type=int, default=None, help="(20; 4 tiny)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts evaluated (all; 8 tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(128; 24 tiny)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", choices=["all", "train", "evaluate"], default="all",
                   help="train both drafts, or evaluate the drafts a train phase left in --work (each phase "
                        "then fits a shorter job; the evaluation takes as long as the training on a GPU)")
    args = p.parse_args(argv)
    if not args.tiny and args.work is None:
        p.error("--work is required without --tiny")
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
    settings = ExtractionSettings.from_config({"backend": "hf", "dtype": "float32", "batch_tokens": 2048,
                                               "shard_tokens": 1024}, model_dtype="float32", device="cpu")
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


def store_dataset(index_path: Path, dtype: torch.dtype):
    """speculators' ``BaseDataset`` over the store: a sample's aux states concatenated in ascending
    layer order, its token ids and loss mask, and the final state as ``verifier_last_hidden_states``
    (stored after the target's final norm; the model's ``verifier_norm`` is an identity here)."""
    from speculators.train.data import BaseDataset

    index = HiddenStateIndex.load(index_path)
    samples = []
    for shard in index.shards:
        offsets = read_shard(index, shard, layer_ids=[], verify=False).offsets.tolist()
        samples += [(shard, a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    class StoreDataset(BaseDataset):
        def __init__(self) -> None:
            self.readers: dict[int, ShardRows] = {}
            super().__init__(max_len=10**9, hidden_states_dtype=dtype)

        def __len__(self) -> int:
            return len(samples)

        def _compute_approx_lengths(self) -> list[int]:
            return [b - a for _, a, b in samples]

        def _get_raw_data(self, i: int) -> dict:
            shard, a, b = samples[i]
            rows = self.readers.get(shard.shard) or self.readers.setdefault(
                shard.shard, ShardRows(index, shard, index.layer_ids))

            def state(layer: int) -> torch.Tensor:
                values, scales = rows.rows(layer, a, b)
                return dequantize_fp8(values, scales, dtype) if scales is not None else values.to(dtype)

            return {"hidden_states": torch.cat([state(i) for i in index.aux_layer_ids], -1),
                    "input_ids": rows.input_ids[a:b].clone(), "loss_mask": rows.loss_mask[a:b].clone(),
                    "verifier_last_hidden_states": state(index.final_layer_id)}

    return StoreDataset()


def speculators_model(inputs: dict, args: argparse.Namespace, device: str):
    """speculators' Eagle3DraftModel of the shape Draftsmith trains, with the target's rows frozen in."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from draftsmith.draft import Eagle3DraftConfig, draft_rows
    from draftsmith.engines.weights import load_embedding_and_head
    from draftsmith.targets.inspect import read_target_json

    target = read_target_json(inputs["target"])
    mapping = load_file(str(inputs["mapping"]))
    ours = Eagle3DraftConfig.from_target(target, draft_vocab_size=int(mapping["d2t"].shape[0]), variant=args.variant,
                                         num_layers=args.num_layers, speculative_tokens=args.ttt_steps,
                                         aux_layer_ids=HiddenStateIndex.load(inputs["index"]).aux_layer_ids)
    config = Eagle3SpeculatorConfig.from_dict(ours.to_speculators())
    config.transformer_layer_config._attn_implementation = "simple_flex_attention" if device == "cuda" else "sdpa"
    torch.manual_seed(args.seed)
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


def train_speculators(inputs: dict, args: argparse.Namespace, steps: int, out: Path, device: str) -> tuple[Path, int]:
    """speculators' Trainer for ``steps`` optimizer steps; returns the saved draft's folder and the steps run."""
    import speculators.train.trainer as trainer_module
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    StepBoundTrainer = step_bound_trainer()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = speculators_model(inputs, args, device)
    loader = _setup_dataloader(store_dataset(inputs["index"], dtype), args.batch_tokens,
                               model.config.transformer_layer_config.hidden_size, num_workers=0,
                               num_target_layers=len(model.target_layer_ids), prefetch_factor=None,
                               preprocess=shift_batch, seed=args.seed)
    # the sampler's batches per epoch vary with its shuffle: epochs enough, those past max_steps skipped
    epochs = math.ceil(steps / len(loader)) + 2
    loss = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": args.ttt_decay,
            "loss_config": resolve_loss_config("kl_div", "eager")}
    config = trainer_module.TrainerConfig(
        lr=args.lr, num_epochs=epochs, save_path=str(out), train_call_kwargs=loss, val_call_kwargs=loss,
        weight_decay=args.weight_decay, scheduler_type="linear", scheduler_warmup_steps=args.warmup_steps,
        scheduler_total_steps=steps, hidden_states_dtype=dtype, log_freq=10**9, max_steps=steps)
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
# Draftsmith's trainer, the evaluation, the table


def train_draftsmith(inputs: dict, args: argparse.Namespace, out: Path, device: str) -> dict:
    from draftsmith.train import run_training, settings_from_dict

    values = {k: getattr(args, k) for k in TRAIN_KEYS}
    settings = settings_from_dict({**values, "seed": args.seed, "device": device, "progress": False,
                                   "dtype": "bfloat16" if device == "cuda" else "float32",
                                   "checkpoint_every": 10**6, "log_every": 10})
    return run_training(inputs["index"], inputs["mapping"], inputs["target"], out / "draft", out / "state", settings,
                        devices=1, metrics_out=out / "metrics.jsonl", summary_out=out / "summary.json")


def evaluate(draft: Path, inputs: dict, args: argparse.Namespace, out: Path, device: str) -> dict:
    from draftsmith.evaluate import EvalSettings, evaluate_draft

    settings = EvalSettings(backend="hf", k=args.k, k_sweep=(args.k,), max_prompts=args.eval_prompts or 10**6,
                            max_new_tokens=args.max_new_tokens, sweep_max_prompts=1)
    result = evaluate_draft(draft, inputs["target"], inputs["heldout"], out, settings, dtype="auto", device=device)
    return {"tau": result["tau"], "acceptance_rate_by_position": result["acceptance_rate_by_position"],
            "num_prompts": result["num_prompts"], "num_tokens": result["num_tokens"],
            "ngram_tau": result["baseline"]["tau"]}


def main(argv=None) -> dict:
    import tempfile

    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="trainer-quality-"))
    inputs = tiny_inputs(work, args.seed) if args.tiny else inputs_in(work, args.store)
    runs = work / "trainer_quality" / f"{args.variant}-{args.num_layers}"  # variants may run side by side
    if args.phase != "evaluate":
        results = train_both(inputs, args, runs)
        if args.phase == "train":
            print(f"both drafts trained in {runs} ({results['seconds']}); evaluate with --phase evaluate")
            return results
    else:
        trained = runs / "trained.json"
        if not trained.is_file():
            raise SystemExit(f"{trained} is missing: run --phase train with the same --work and settings first")
        results = json.loads(trained.read_text(encoding="utf-8"))
        results["settings"].update(k=args.k, max_new_tokens=args.max_new_tokens)  # this phase's evaluation
    for name in ("draftsmith", "speculators"):
        draft = Path(results[name]["draft"])
        results[name].update(evaluate(draft, inputs, args, runs / name / "acceptance.json", args.device))
    results["tau_ratio"] = results["draftsmith"]["tau"] / results["speculators"]["tau"]
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def train_both(inputs: dict, args: argparse.Namespace, runs: Path) -> dict:
    """Both trainers from step 0 into ``runs``; what they did is also written to ``runs/trained.json``."""
    import shutil

    shutil.rmtree(runs, ignore_errors=True)  # both trainers start from step 0, and their drafts are this run's
    start = time.perf_counter()
    summary = train_draftsmith(inputs, args, runs / "draftsmith", args.device)
    seconds = {"draftsmith_train": time.perf_counter() - start}
    start = time.perf_counter()
    theirs, their_steps = train_speculators(inputs, args, summary["steps"], runs / "speculators", args.device)
    seconds["speculators_train"] = time.perf_counter() - start
    results = {"settings": {k: getattr(args, k) for k in (*TRAIN_KEYS, "k", "max_new_tokens", "seed", "device")},
               "inputs": {k: str(v) for k, v in inputs.items()}, "steps": summary["steps"],
               "speculators_steps": their_steps, "tokens": summary["tokens"], "seconds": seconds, "tiny": args.tiny,
               "draftsmith": {"draft": str(runs / "draftsmith" / "draft")}, "speculators": {"draft": str(theirs)}}
    (runs / "trained.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def print_table(results: dict) -> None:
    s = results["settings"]
    print(f"\n{results['steps']} steps of {s['batch_tokens']} batch tokens ({results['tokens']} tokens), "
          f"{s['variant']} x {s['num_layers']} layer(s), TTT {s['ttt_steps']}, lr {s['lr']}, k = {s['k']}")
    print(f"{'trainer':<12} {'tau':>6} {'accept by position':>28} {'train s':>8}")
    for name in ("draftsmith", "speculators"):
        r = results[name]
        by_pos = " ".join(f"{a:.3f}" for a in r["acceptance_rate_by_position"])
        print(f"{name:<12} {r['tau']:>6.3f} {by_pos:>28} {results['seconds'][name + '_train']:>8.1f}")
    print(f"tau ratio (Draftsmith / speculators) {results['tau_ratio']:.3f}; n-gram baseline tau "
          f"{results['draftsmith']['ngram_tau']:.3f}; {results['draftsmith']['num_prompts']} prompts")


if __name__ == "__main__":
    main()
