"""Built-in tiny models for fast tests: fixed configs, seeded random weights, a trained tokenizer.

`build_tiny_checkpoint` writes a complete Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template) from a seed, so
every test can have a real model in milliseconds and without a download. The same seed gives
byte-identical files. The weights are random: the outputs are meaningless but deterministic.
Never use these for anything but tests and benchmarks of the machinery.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from worker.checkpoint import expected_shapes, save_checkpoint
from worker.config import ModelConfig, RopeScaling
from worker.model import CausalLM

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2, as in SmolLM2's vocabulary."""
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    architecture="llama",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
"""Llama: GQA 4:2, separate LM head, plain RoPE."""

TINY_QWEN3_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    architecture="qwen3",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(
        kind="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)
"""Qwen3-style: GQA 8:2, per-head QK-norm, tied embeddings, q width (128) != hidden (64), and
llama3 RoPE scaling whose 64-token original context puts this head_dim's frequencies in all three
bands (kept, interpolated, divided by the factor)."""

CORPUS = """\
The cache remembers what the model has already read. When a new request arrives, the router asks
every worker how much of the prompt it has seen before, and sends the request to the one that has
seen the most. That worker skips the work for the shared beginning and computes only the rest.

A radix tree stores token sequences by their common prefixes. Each node holds a run of tokens and
the pages of memory where their keys and values live. Matching walks down from the root; inserting
splits a node where two sequences part ways. Pages that no running request holds can be evicted,
least recently used first, whenever the pool runs short.

def match(tree, tokens):
    node, depth = tree.root, 0
    while depth < len(tokens) and tokens[depth] in node.children:
        node = node.children[tokens[depth]]
        depth += len(node.tokens)
    return node, depth

Numbers matter too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 128, 1024, 65536, 3.14159 and 2.71828.
Punctuation, quotes and brackets: "yes", 'no', (maybe), [list], {dict}, <tag>, a/b, a-b, a_b.
Weather report: clear skies over the hills this morning, rain by the evening, a cold wind later.
Cafe, naive, resume, facade: words that other languages lend. Grüße aus München! Ça va très bien.
Привет, мир. Γειά σου κόσμε. 你好，世界。こんにちは世界。안녕하세요 세계. 🙂 🚀 ✓ → ∑ π.
Questions and answers: What is the capital of France? Paris. How many legs does a spider have?
Eight. Which planet is closest to the sun? Mercury. What do bees make? Honey and wax.
Long ago, in a quiet town by the sea, there lived a clockmaker who built clocks that never lost a
second. People came from far away to watch the gears turn, and the clockmaker told each of them
the same story: every tick is small, but together they carry the whole day.
"""


@cache
def tiny_tokenizer_json(vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> str:
    """A byte-level BPE tokenizer trained on `CORPUS` to exactly `vocab_size` tokens, as JSON;
    `special_tokens` take the first ids."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    size = backend.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(
            f"the tiny corpus trains {size} tokens, not the {vocab_size} the config asks for "
            f"(at least {len(special_tokens) + 256} and at most what the corpus can merge)"
        )
    return backend.to_str(pretty=True)


def tiny_tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 1024,
    }


def tiny_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 normal weights, by standard deviation: projections 1/sqrt(fan_in) so every
    layer changes the residual stream (with std 0.02 the model degenerates into repeating its
    input); embedding and LM head 1/sqrt(hidden) so logits have unit scale; norms 1 +- 0.1."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if "norm" in name:
            std, mean = 0.1, 1.0
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            std, mean = config.hidden_size**-0.5, 0.0
        else:
            std, mean = shape[-1] ** -0.5, 0.0
        state[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * std + mean
    return state


def tiny_model(config: ModelConfig = TINY_CONFIG, seed: int = 0) -> CausalLM:
    """A model of `config` holding `tiny_state_dict(config, seed)`, in eval mode (no files)."""
    model = CausalLM(config)
    model.load_weights(tiny_state_dict(config, seed))
    return model.eval()


def build_tiny_checkpoint(
    path: Path,
    config: ModelConfig = TINY_CONFIG,
    seed: int = 0,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
) -> Path:
    """Write a tiny checkpoint directory at `path` (created if needed) and return it. More
    `special_tokens` than `SPECIAL_TOKENS` (which they must begin with) take ids from the
    vocabulary's merges (a code model's fill-in-the-middle tokens, say)."""
    assert special_tokens[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    files = {
        "tokenizer.json": tiny_tokenizer_json(config.vocab_size, special_tokens),
        "tokenizer_config.json": json.dumps(tiny_tokenizer_config(), indent=2, sort_keys=True),
    }
    return save_checkpoint(Path(path), config, tiny_state_dict(config, seed), files)
