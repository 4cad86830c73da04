"""Builders for tiny random-init models and tokenizers, saved as real Hugging Face folders.

Nothing is downloaded: tokenizers are trained here on a few sentences, models are random-init
from ``transformers`` configs. head_dim is 32 so the same models also run under vLLM's CPU build.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Tool-use templates in the shapes of Qwen2.5 (ChatML: <tool_call> blocks, tool results as
# <tool_response> in a user turn) and Llama 3.1 (a bare JSON call, results in an ipython turn),
# cut down to what the loss mask depends on.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>\n' }}{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ call['function']['arguments'] | tojson + '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% for call in message['tool_calls'] %}{{ '{\"name\": \"' + call['function']['name'] + '\", "
    "\"parameters\": ' + call['function']['arguments'] | tojson + '}' }}{% endfor %}{{ '<|eot_id|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% else %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CORPUS = [
    "Hello there, how are you doing today?",
    "I am fine, thank you. What is the weather like?",
    "It is sunny and warm. Do you like the sun?",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and the target verifies them.",
    "user assistant system tool: one two three four five six seven eight nine ten",
    "What is your name? My name is Draftsmith. Nice to meet you!",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}-_/",
]


def build_tokenizer(path: str | Path, template: str = CHATML_TEMPLATE, vocab_size: int = 384,
                    corpus: list[str] | None = None) -> Path:
    """Train a byte-level BPE tokenizer with a chat template (on ``corpus``, a few sentences by
    default) and save it as a HF folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4 if corpus is None else corpus, trainer=trainer)
    llama3 = template in (LLAMA3_TEMPLATE, LLAMA3_TOOLS_TEMPLATE)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>" if llama3 else None,
        eos_token="<|eot_id|>" if llama3 else "<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = template
    path = Path(path)
    fast.save_pretrained(path)
    return path


def llama_config(vocab_size: int = 384, num_layers: int = 8, hidden_size: int = 64, **overrides) -> LlamaConfig:
    """A Llama config small enough for CPU tests; head_dim 32 as vLLM's CPU build requires."""
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 32, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_llama(path: str | Path, tokenizer_template: str | None = CHATML_TEMPLATE, seed: int = 0,
                **config_overrides) -> Path:
    """Save a random-init LlamaForCausalLM (and a tokenizer, unless template is None)."""
    path = Path(path)
    if tokenizer_template is not None:
        build_tokenizer(path, tokenizer_template)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**config_overrides)).eval()
    _spread_weights(model)
    model.save_pretrained(path)
    return path


def build_llava(path: str | Path, seed: int = 0, **text_overrides) -> Path:
    """Save a random-init multimodal wrapper (Llava) whose language model is a tiny Llama."""
    path = Path(path)
    build_tokenizer(path)
    text = llama_config(**text_overrides)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=1, image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=text.vocab_size - 1,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _spread_weights(model)
    model.save_pretrained(path)
    return path


def _spread_weights(model: torch.nn.Module) -> None:
    """Random-init weights (std 0.02) make every layer's output nearly identical; larger ones make
    hidden states and next-token distributions differ enough for tests to tell layers apart."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)


def write_jsonl(path: str | Path, rows: list) -> Path:
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path

def random_train_rows(count: int, seed: int = 0, vocab_size: int = 384) -> list[dict]:
    """train.jsonl rows of random tokens, 4..40 long, the last two thirds of each in the loss."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = rng.randint(4, 40)
        rows.append({"id": f"s{i}", "input_ids": [rng.randrange(1, vocab_size) for _ in range(n)],
                     "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)})
    return rows



KIMI_K25_TEXT_CONFIG = dict(
    # Kimi-K2.5's text model: DeepSeek-V3 architecture, 61 layers, 384 routed experts, MLA.
    model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    n_shared_experts=1, n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
    num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=262144,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "rope_theta": 50000.0},
)


def build_kimi_k25_config(path: str | Path) -> Path:
    """A folder with Kimi-K2.5's config (a DeepSeek-V3 text model inside a multimodal wrapper) and a
    tokenizer, but no weights: enough for preflight, which never reads weights."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    path = Path(path)
    config = Kimi_K25Config(text_config=dict(KIMI_K25_TEXT_CONFIG), tie_word_embeddings=False)
    config.architectures = ["KimiK25ForConditionalGeneration"]
    config.save_pretrained(path)
    build_tokenizer(path)
    return path
