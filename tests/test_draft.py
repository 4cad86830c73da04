"""The EAGLE-3 draft: its math against a plain reference, speculators and vLLM formats, incremental drafting."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.draft.config import VARIANTS, Eagle3DraftConfig
from draftsmith.draft.model import DraftKVCache, Eagle3Draft
from draftsmith.draft.speculators_format import load_speculators, save_speculators
from draftsmith.errors import TrainingError
from draftsmith.train import TTTObjective, scored_positions
from draftsmith.train.attention import document_blocks

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 384, 100


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def make_draft(num_layers: int = 1, norm_before_residual: bool = True, seed: int = 0,
               aux_layer_ids=(1, 2, 3), dtype=torch.float64, variant: str = "eagle3", **flags) -> Eagle3Draft:
    config = Eagle3DraftConfig(
        hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
        target_vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=list(aux_layer_ids),
        num_layers=num_layers, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_before_residual=norm_before_residual,
        verifier_name_or_path="/nonexistent/target", verifier_architectures=["LlamaForCausalLM"],
        **{**VARIANTS[variant], **flags})
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    draft.load_target_weights(embed, head, ids - torch.arange(DRAFT_VOCAB), t2d)
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in draft.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed" not in name and "lm_head" not in name:
                p.normal_(0, 0.15, generator=g)
    return draft.to(dtype)


def packed_batch(lengths, num_aux: int = 3, seed: int = 0, dtype=torch.float64):
    """Packed inputs as the trainer builds them: ids[t] = x[t+1] within the sample (step j reads
    x[t+1+j] from row t+j)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    aux = torch.randn(total, num_aux * HIDDEN, generator=g, dtype=dtype)
    tokens = [torch.randint(0, VOCAB, (m,), generator=g) for m in lengths]
    pos = torch.cat([torch.arange(1, m + 1) for m in lengths])
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return aux, torch.cat(tokens), pos, doc, tokens


def reference_logits(draft: Eagle3Draft, aux: torch.Tensor, tokens: torch.Tensor, ttt_steps: int):
    """One sample, position by position: step j's query at t attends to step 0's keys at s <= t
    and to steps 1..j's keys at t (the EAGLE-3 / speculators TTT pattern), token x[t+1+j],
    position t+1+j, hidden state = step j-1's output at t."""
    c = draft.config
    w = {k: v.double() for k, v in draft.state_dict().items() if v.is_floating_point()}
    m = aux.shape[0]
    group = c.num_attention_heads // c.num_key_value_heads
    inv_freq = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, c.head_dim, 2).double() / c.head_dim))

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, position):  # x [heads, D]
        angles = position * inv_freq
        cos, sin = torch.cat([angles.cos(), angles.cos()]), torch.cat([angles.sin(), angles.sin()])
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def mlp(x, p):
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        return (torch.nn.functional.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T

    if c.fc_norm:  # EAGLE 3.1: each captured state normalised on its own before fc
        aux = torch.cat([rms(a, w[f"fc_norm.{i}.weight"]) for i, a in enumerate(aux.double().chunk(c.num_aux, -1))], -1)
    hidden = aux.double() @ w["fc.weight"].T
    first_keys = [[None] * m for _ in range(c.num_layers)]
    chain_keys = [[[] for _ in range(m)] for _ in range(c.num_layers)]
    out = []
    for j in range(ttt_steps):
        token = torch.stack([tokens[t + j] if t + j < m else torch.tensor(0) for t in range(m)])
        embeds = w["embed_tokens.weight"][token]
        x_all = hidden
        for layer in range(c.num_layers):
            p = f"layers.{layer}."
            if layer == 0:
                normed = rms(x_all, w[p + "hidden_norm.weight"])
                residual = normed if c.norm_before_residual else x_all
                attn_in = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], -1)
            else:
                residual = x_all
                attn_in = rms(x_all, w[p + "input_layernorm.weight"])
            qs, ks, vs = [], [], []
            for t in range(m):
                position = t + 1 + j
                q = (attn_in[t] @ w[p + "self_attn.q_proj.weight"].T).view(c.num_attention_heads, c.head_dim)
                k = (attn_in[t] @ w[p + "self_attn.k_proj.weight"].T).view(c.num_key_value_heads, c.head_dim)
                v = (attn_in[t] @ w[p + "self_attn.v_proj.weight"].T).view(c.num_key_value_heads, c.head_dim)
                qs.append(rope(q, position))
                ks.append(rope(k, position))
                vs.append(v)
                if j == 0:
                    first_keys[layer][t] = (ks[-1], v)
                else:
                    chain_keys[layer][t].append((ks[-1], v))
            new = []
            for t in range(m):
                keys = [first_keys[layer][s] for s in range(t + 1)] + chain_keys[layer][t]
                heads = []
                for h in range(c.num_attention_heads):
                    scores = torch.stack([qs[t][h] @ k[h // group] for k, _ in keys]) / c.head_dim ** 0.5
                    probs = torch.softmax(scores, 0)
                    heads.append(sum(pr * v[h // group] for pr, (_, v) in zip(probs, keys)))
                attn = torch.cat(heads) @ w[p + "self_attn.o_proj.weight"].T
                x = residual[t] + attn
                new.append(x + mlp(rms(x, w[p + "post_attention_layernorm.weight"]), p))
            x_all = torch.stack(new)
        normed = rms(x_all, w["norm.weight"])
        hidden = normed if c.norm_output else x_all  # EAGLE 3.1 feeds the post-norm state on
        out.append(normed @ w["lm_head.weight"].T)
    return out


def unroll(draft, aux, ids, pos, doc, attention="sdpa", ttt_steps: int = 3):
    objective = TTTObjective(draft, torch.zeros(VOCAB, HIDDEN, dtype=aux.dtype), torch.arange(DRAFT_VOCAB),
                             ttt_steps=ttt_steps, ttt_decay=1.0, attention=attention)
    return [draft.lm_head(x) for x in objective.unroll(aux, ids, pos, doc)]


@pytest.mark.parametrize("num_layers,norm_before_residual,variant",
                         [(1, True, "eagle3"), (1, False, "eagle3"), (2, True, "eagle3"), (1, True, "eagle3.1"),
                          (3, False, "eagle3.1")])
def test_packed_ttt_forward_matches_reference_per_sample(num_layers, norm_before_residual, variant):
    draft = make_draft(num_layers, norm_before_residual, variant=variant)
    lengths = [7, 1, 12, 4]
    aux, ids, pos, doc, tokens = packed_batch(lengths)
    logits = unroll(draft, aux, ids, pos, doc)
    o = 0
    for m, x in zip(lengths, tokens):
        ref = reference_logits(draft, aux[o:o + m], x, 3)
        for j in range(3):  # the rows step j can score: past them it reads the next sample's tokens
            torch.testing.assert_close(logits[j][o:o + m - j], ref[j][:m - j], rtol=1e-5, atol=1e-5)
        o += m


def prompt_and_answer_valid(lengths, ttt_steps: int = 3, seed: int = 0) -> torch.Tensor:
    """valid [K, T] as chat data gives it: per sample a prompt block without loss, then answer tokens."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.cat([torch.arange(m) >= torch.randint(0, m, (1,), generator=g) for m in lengths])
    valid = torch.zeros(ttt_steps, len(loss), dtype=torch.bool)
    o = 0
    for m in lengths:
        for j in range(min(ttt_steps, m)):
            valid[j, o:o + m - j] = loss[o + j:o + m]
        o += m
    return valid


@pytest.mark.parametrize("num_layers", [1, 2])
def test_rows_nothing_uses_are_skipped_without_changing_the_rest(num_layers):
    """``keep``: the last layer's output projection and MLP only on rows some TTT step scores (at
    that step or later): the kept rows' states and every gradient equal the full computation's."""
    draft = make_draft(num_layers)
    lengths = [9, 2, 15, 6]
    aux, ids, pos, doc, _ = packed_batch(lengths)
    positions = scored_positions(prompt_and_answer_valid(lengths))
    keep = positions["keep"].split(positions["keep_splits"])
    picks = positions["pick"].split(positions["splits"])
    rows = positions["rows"].split(positions["splits"])
    assert len(keep[0]) < aux.shape[0] and len(keep[2]) < len(keep[1]) < len(keep[0])  # something is skipped
    results = []
    for use_keep in (False, True):
        draft.zero_grad(set_to_none=True)
        objective = TTTObjective(draft, torch.zeros(VOCAB, HIDDEN), torch.arange(DRAFT_VOCAB), ttt_steps=3,
                                 ttt_decay=1.0, attention="sdpa")
        states = list(objective.unroll(aux, ids, pos, doc, keep if use_keep else None))
        scored = [x[(picks if use_keep else rows)[j]] for j, x in enumerate(states)]
        sum((draft.lm_head(x) * torch.linspace(-1, 1, DRAFT_VOCAB)).sum() * (j + 1)
            for j, x in enumerate(scored)).backward()
        results.append((scored, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (full, full_grads), (kept, kept_grads) = results
    for a, b in zip(full, kept):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    assert kept_grads.keys() == full_grads.keys()
    for name, g in full_grads.items():
        torch.testing.assert_close(kept_grads[name], g, rtol=1e-9, atol=1e-9, msg=name)


def test_document_blocks_group_whole_samples():
    """The CPU's attention blocks: consecutive, covering every row, never splitting a sample,
    within the row budget unless one sample is longer."""
    lengths = [60, 90, 20, 150, 3, 40, 1, 1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    blocks = document_blocks(doc, rows=128)
    assert blocks == [(0, 60), (60, 170), (170, 320), (320, 365)]
    assert document_blocks(doc[:60], rows=128) == [(0, 60)]


def test_sdpa_block_by_block_equals_the_whole_batch(monkeypatch):
    """Attention computed per block of whole samples (the CPU's path) gives the dense whole-batch
    attention's outputs and gradients: no row ever attended outside its sample."""
    import draftsmith.train.attention as attention

    lengths = [60, 90, 20, 150, 3, 40]  # blocks (0, 60), (60, 170), (170, 320), (320, 363)
    aux, ids, pos, doc, _ = packed_batch(lengths)
    assert len(attention.document_blocks(doc)) == 4
    results = {}
    for blocked in (True, False):
        if not blocked:
            monkeypatch.setattr(attention, "document_blocks", lambda d: [(0, d.shape[0])])
        draft = make_draft(2)
        logits = unroll(draft, aux, ids, pos, doc)
        sum((lg * torch.linspace(-1, 1, lg.shape[-1])).sum() * (j + 1) for j, lg in enumerate(logits)).backward()
        results[blocked] = ([lg.detach() for lg in logits],
                            {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    for a, b in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert len(results[True][1]) == len(results[False][1]) > 10
    for name, g in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], g, rtol=1e-9, atol=1e-9, msg=name)


def dense_flex(q, k, v, block_mask, scale, enable_gqa, return_aux):
    """flex_attention's contract in plain autograd math (flex has no CPU backward)."""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import create_mask

    t = q.shape[2]
    mask = create_mask(block_mask.mask_mod, 1, 1, t, t, device=q.device)
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v.repeat_interleave(group, 1), SimpleNamespace(lse=lse)


def test_flex_attention_path_matches_sdpa_path():
    """The GPU path (flex over the causal part, same-position TTT keys merged through the LSE)
    against the CPU path (concatenated keys, explicit mask): torch's flex kernel forward, and the
    merge's gradients through a dense stand-in for flex (flex has no CPU backward)."""
    draft = make_draft(2).float()
    aux, ids, pos, doc, _ = packed_batch([9, 5, 14], dtype=torch.float32)
    with torch.no_grad():
        for a, b in zip(unroll(draft, aux, ids, pos, doc, "sdpa"), unroll(draft, aux, ids, pos, doc, "flex")):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    draft = draft.double()
    aux = aux.double()
    grads = {}
    for impl, flex_fn in (("sdpa", None), ("flex", dense_flex)):
        draft.zero_grad(set_to_none=True)
        objective = TTTObjective(draft, torch.zeros(VOCAB, HIDDEN), torch.arange(DRAFT_VOCAB), ttt_steps=3,
                                 ttt_decay=1.0, attention=impl, flex_fn=flex_fn)
        logits = [draft.lm_head(x) for x in objective.unroll(aux, ids, pos, doc)]
        sum((lg * torch.linspace(-1, 1, lg.shape[-1])).sum() * (j + 1) for j, lg in enumerate(logits)).backward()
        grads[impl] = ([lg.detach() for lg in logits],
                       {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    for a, b in zip(grads["sdpa"][0], grads["flex"][0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert len(grads["sdpa"][1]) == len(grads["flex"][1]) > 10
    for name, g in grads["sdpa"][1].items():
        torch.testing.assert_close(grads["flex"][1][name], g, rtol=1e-9, atol=1e-9, msg=name)


def test_compiled_gpu_path_traces_whole_and_matches(monkeypatch):
    """The GPU configuration (the TTT steps torch.compile'd as one graph, calling compiled flex
    attention with its LSE) through Dynamo and AOTAutograd (backend aot_eager: no Triton here): no
    graph breaks, one graph for all TTT steps and none per batch (their kept row counts differ), and
    forward and backward equal to the SDPA path. Only flex's CPU guard against backward is lifted:
    its dense math is what runs here."""
    import torch._dynamo
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    draft = make_draft(1).float()
    flex = torch.compile(fa.flex_attention, dynamic=False, backend="aot_eager")
    reference = TTTObjective(draft, torch.zeros(VOCAB, HIDDEN), torch.arange(DRAFT_VOCAB), ttt_steps=3,
                             ttt_decay=1.0, attention="sdpa")
    compiled = TTTObjective(draft, torch.zeros(VOCAB, HIDDEN), torch.arange(DRAFT_VOCAB), ttt_steps=3,
                            ttt_decay=1.0, attention="flex", flex_fn=flex).compile_steps("aot_eager")
    for seed, lengths in enumerate(([40, 30, 58], [100, 28])):
        aux, ids, pos, doc, _ = packed_batch(lengths, dtype=torch.float32, seed=seed)
        positions = scored_positions(prompt_and_answer_valid(lengths, seed=seed))
        keep = positions["keep"].split(positions["keep_splits"])  # row counts differ between the batches
        results = []
        for objective in (reference, compiled):
            draft.zero_grad(set_to_none=True)
            if objective is compiled:  # as training runs it: skipping rows no step scores
                states = objective.unroll(aux, ids, pos, doc, keep)
            else:
                states = [x[rows] for x, rows in zip(objective.unroll(aux, ids, pos, doc), keep)]
            logits = [draft.lm_head(x) for x in states]
            sum((lg * torch.linspace(-1, 1, lg.shape[-1])).sum() for lg in logits).backward()
            results.append((logits, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
        (ref, ref_grads), (out, grads) = results
        for a, b in zip(ref, out):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-4)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=name)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]  # the TTT steps, flex inlined
    torch._dynamo.reset()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_incremental_drafting_reproduces_every_ttt_step(variant):
    """draft_step with a KV cache (what speculative decoding runs) gives training's logits at
    every TTT step, when the cache holds the verified prefix plus this chain's draft positions."""
    draft = make_draft(2, variant=variant)
    m, steps = 10, 3
    aux, ids, pos, doc, (tokens,) = packed_batch([m])
    trained = unroll(draft, aux, ids, pos, doc, ttt_steps=steps)
    cache = DraftKVCache(draft.config.num_layers)
    hidden0, logits0 = draft.draft_step(aux, tokens, pos, cache)
    torch.testing.assert_close(logits0, trained[0], rtol=1e-6, atol=1e-6)
    for t in (0, 4, m - 3):
        cache.crop(t + 1)  # the verified prefix ends at position t
        hidden = hidden0[t:t + 1]
        for j in range(1, steps):
            hidden, logits = draft.draft_step(hidden, tokens[t + j:t + j + 1], pos[t:t + 1] + j, cache, fused=True)
            torch.testing.assert_close(logits[0], trained[j][t], rtol=1e-6, atol=1e-6)
        # redo the prefix for the next chain: re-run step 0 on the rest
        cache.crop(t + 1)
        draft.draft_step(aux[t + 1:], tokens[t + 1:], pos[t + 1:], cache)


@pytest.mark.parametrize("num_layers,variant,flags", [(1, "eagle3", {}), (2, "eagle3.1", {}),
                                                      (1, "eagle3", {"norm_before_fc": True, "norm_output": True})])
def test_saved_draft_loads_in_speculators_and_matches_its_forward(tmp_path, num_layers, variant, flags):
    """config.json parses with speculators 0.9's Eagle3SpeculatorConfig, the weights load strictly
    into its Eagle3DraftModel, and its own TTT forward gives our loss and our per-step tokens: plain
    EAGLE-3, EAGLE 3.1 with two layers (fc_norm, norm_output), and speculators' trainer default
    (norm_before_fc, norm_output)."""
    pytest.importorskip("speculators")
    from safetensors.torch import load_file
    from speculators import SpeculatorModel
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from torch.nn.attention.flex_attention import create_mask

    from tests.tiny import build_llama

    verifier = build_llama(tmp_path / "target", tokenizer_template=None, num_layers=4)
    draft = make_draft(num_layers, True, aux_layer_ids=(1, 2, 3), variant=variant, **flags).float()
    draft.config.verifier_name_or_path = str(verifier)
    save_speculators(draft, tmp_path / "draft", dtype="float32")
    raw = json.loads((tmp_path / "draft" / "config.json").read_text())
    config = Eagle3SpeculatorConfig.from_dict(raw)
    assert config.transformer_layer_config.model_type == "llama"
    assert config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert config.norm_before_residual is True and config.draft_vocab_size == DRAFT_VOCAB
    assert config.transformer_layer_config.num_hidden_layers == num_layers
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(config, flag) is getattr(draft.config, flag), flag

    config.transformer_layer_config._attn_implementation = "sdpa"
    missing, unexpected = Eagle3DraftModel(config).load_state_dict(
        load_file(tmp_path / "draft" / "model.safetensors"), strict=False)
    assert not unexpected
    assert set(missing) == {"verifier_lm_head.weight", "verifier_norm.weight"}  # filled from the verifier
    theirs = SpeculatorModel.from_pretrained(tmp_path / "draft")  # the loading path users take
    assert isinstance(theirs, Eagle3DraftModel) and theirs.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    theirs.config.transformer_layer_config._attn_implementation = "sdpa"
    theirs._attn_impl, theirs._create_mask_fn = "sdpa", create_mask
    for name, tensor in draft.state_dict().items():
        if not name.startswith("rotary."):
            torch.testing.assert_close(theirs.state_dict()[name], tensor, msg=name)

    # same inputs through both: speculators applies verifier_norm to the pre-norm last state;
    # our final state is post-norm, as the target's lm_head consumes it
    m = 23
    aux, ids, pos, doc, (tokens,) = packed_batch([m], dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prenorm = torch.randn(m, HIDDEN, generator=g) * 3
    loss_mask = torch.rand(m, generator=g) > 0.3
    with torch.no_grad():
        theirs.verifier_norm.weight.copy_(1 + 0.5 * torch.rand(HIDDEN, generator=g))
        theirs.verifier_lm_head.weight.copy_(draft.lm_head.weight * 1.7)
        final = theirs.verifier_norm(prenorm)
    theirs.eval()
    tokens_theirs, loss_theirs, metrics = theirs(
        hidden_states=aux[None], input_ids=tokens[None], document_ids=torch.zeros(1, m, dtype=torch.long),
        loss_mask=loss_mask[None], position_ids=pos[None], verifier_last_hidden_states=prenorm[None],
        ttt_steps=3, ttt_step_loss_decay=0.8, loss_config=resolve_loss_config("kl_div", "eager"))

    lm_head_full = torch.zeros(VOCAB, HIDDEN)
    rows = torch.arange(DRAFT_VOCAB) + draft.d2t
    lm_head_full[rows] = draft.lm_head.weight.detach() * 1.7
    objective = TTTObjective(draft, lm_head_full, rows, ttt_steps=3, ttt_decay=0.8, attention="sdpa")
    valid = torch.zeros(3, m, dtype=torch.bool)
    for j in range(3):
        valid[j, :m - j] = loss_mask[j:]
    counts = valid.sum(1).double()
    weights = (torch.tensor([0.8 ** j for j in range(3)], dtype=torch.float64) / counts).float()
    with torch.no_grad():
        batch = {"aux": aux, "final": final, "ids": ids, "valid": valid, "pos": pos, "doc": doc,
                 **scored_positions(valid)}
        loss, stats = objective(batch, weights)
        ours = [draft.lm_head(x).argmax(-1) for x in objective.unroll(aux, ids, pos, doc)]
    torch.testing.assert_close(loss, loss_theirs.float(), rtol=1e-4, atol=1e-5)
    for j in range(3):
        assert torch.equal(ours[j][:m - j], tokens_theirs[j][0][:m - j]), j
        assert metrics[f"full_acc_{j}_total"].item() == valid[j].sum().item()


def test_config_parses_for_vllm_eagle3():
    """vLLM's speculators parser turns our config.json into an Eagle3LlamaForCausalLM draft config
    with our aux layers, their count, the draft vocabulary and norm_before_residual."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    draft = make_draft(1, aux_layer_ids=(2, 5))
    raw = draft.config.to_speculators()
    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert parsed["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert parsed["eagle_aux_hidden_state_layer_ids"] == [2, 5]
    assert parsed["num_aux_hidden_states"] == 2  # vLLM sizes fc from this, else assumes 3
    assert parsed["draft_vocab_size"] == DRAFT_VOCAB and parsed["vocab_size"] == VOCAB
    assert parsed["norm_before_residual"] is True
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw) == {"method": "eagle3",
                                                                     "num_speculative_tokens": 3}


def test_eagle31_config_is_read_by_vllm_releases_with_and_without_the_top_level_fields():
    """vLLM 0.32 copies fc_norm and norm_output from config.json's top level; vLLM 0.24's algos.py
    does not, but builds the draft's PretrainedConfig from transformer_layer_config, whose copies
    its llama_eagle3.py then reads with getattr."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = make_draft(2, variant="eagle3.1").config.to_speculators()
    assert raw["fc_norm"] is True and raw["norm_output"] is True and raw["norm_before_fc"] is False
    assert raw["transformer_layer_config"]["fc_norm"] is True and raw["transformer_layer_config"]["norm_output"] is True
    parsed = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    assert parsed["fc_norm"] is True and parsed["norm_output"] is True and parsed["num_hidden_layers"] == 2
    plain = make_draft(1).config.to_speculators()
    assert not any(plain[f] or plain["transformer_layer_config"].get(f) for f in ("fc_norm", "norm_output"))


def test_variants_from_the_target_and_refusals():
    target = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "aux_layer_ids": [1, 2, 3],
              "text_config": {"num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": 1}}
    for variant in VARIANTS:
        config = Eagle3DraftConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB, num_layers=2, variant=variant)
        assert config.variant == variant and config.num_layers == 2
        assert Eagle3DraftConfig.from_speculators(config.to_speculators()) == config
    with pytest.raises(TrainingError, match="draft.variant"):
        Eagle3DraftConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB, variant="eagle4")
    with pytest.raises(TrainingError, match="norm_before_fc and fc_norm"):
        make_draft(fc_norm=True, norm_before_fc=True)
    assert make_draft(norm_before_fc=True, norm_output=True).config.variant is None  # speculators' default


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_pytorch_tanh", "relu"])
def test_the_draft_runs_silu_whatever_the_targets_activation(activation):
    """vLLM's EAGLE-3 Llama draft builds LlamaMLP, which takes SiLU only: a draft that copied GPT-2's
    gelu or Gemma's tanh gelu could be trained but not served."""
    target = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "aux_layer_ids": [1, 2, 3],
              "text_config": {"num_attention_heads": 2, "hidden_act": activation, "hidden_activation": activation}}
    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB)
    assert config.hidden_act == "silu" and config.transformer_layer_config()["hidden_act"] == "silu"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_load_roundtrip(tmp_path, variant):
    draft = make_draft(2, False, variant=variant).float()
    save_speculators(draft, tmp_path / "d", dtype="float32")
    loaded = load_speculators(tmp_path / "d")
    assert loaded.config == draft.config
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not loaded.embed_tokens.weight.requires_grad


def test_kimi_k25_shaped_target_gets_a_servable_llama_draft():
    """An MLA target (Kimi-K2.5 / DeepSeek-V3) has no Llama attention layout to copy: the draft gets
    128-dim heads, hidden/128 of them, 8 key/value heads, plain RoPE at the target's theta."""
    from tests.tiny import KIMI_K25_TEXT_CONFIG

    target = {"hidden_size": 7168, "vocab_size": 163840, "aux_layer_ids": [2, 30, 58], "final_layer_id": 61,
              "architecture": "KimiK25ForConditionalGeneration", "model_path": "/models/Kimi-K2.5",
              "text_config": dict(KIMI_K25_TEXT_CONFIG)}
    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=32000)
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (56, 128, 8)
    assert config.intermediate_size == 18432 and config.rope_parameters == {"rope_type": "default",
                                                                           "rope_theta": 50000.0}
    tl = config.transformer_layer_config()
    assert tl["model_type"] == "llama" and tl["vocab_size"] == 163840
    assert config.to_speculators()["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
