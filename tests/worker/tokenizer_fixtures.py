"""The tokenizers the text index is tested with, and texts that probe split tokenization.

`smollm2_tokenizer()`: the default model's (byte-level BPE, Digits then ByteLevel pre-tokenizer,
17 special tokens), from the converted checkpoint in ~/.cache/radixmesh (converted on first use).
`tiny_tokenizer()`: the tiny model's (byte-level BPE trained on a paragraph, 3 special tokens),
from its tokenizer files alone. `bare_tokenizer()`: SmolLM2's without special tokens.
`texts()`: strings built from pieces that make tokenizers look ahead: whitespace runs,
punctuation, contractions, digits, multi-byte characters, special-token strings whole and cut.
"""

from __future__ import annotations

import json
from functools import cache

from hypothesis import strategies as st

from worker.default_model import default_model_dir
from worker.tiny_model import TINY_CONFIG, tiny_tokenizer_config, tiny_tokenizer_json
from worker.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

FRAGMENTS = [
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\n\n\n",
    " \n",
    "\t",
    "\r\n",
    "\u00a0",
    "Hello",
    " world",
    "the",
    " cat",
    "'s",
    "'ll",
    "'S",
    " don't",
    "I'm",
    "1",
    "123",
    " 4567",
    "3.14",
    "é",
    " café",
    "Grüße",
    "漢字",
    " 漢",
    "こんにちは",
    "🙂",
    "👍🏽",
    "!",
    "!!",
    "?",
    "...",
    ",",
    "-",
    "(",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<jupyter_output>",
    "<|im_sta",
    "<|im_",
    "<|",
    "|>",
    "<",
    "im_start|>",
    "user",
    "assistant",
    "\x04",
    "\x13",
    "\U00040000",
]
"""Pieces of text whose neighbours change how they tokenise. The last three have bytes that
SmolLM2's vocabulary lacks: encoding drops those bytes."""


def texts(max_pieces: int = 8) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=3),
        st.text(" \n\tab.'1é", min_size=1, max_size=4),
    )
    return st.lists(piece, max_size=max_pieces).map("".join)


PREAMBLES = [
    "<|im_start|>system\nYou are a helpful assistant. Answer in one short paragraph, "
    "and say so when you do not know.<|im_end|>\n<|im_start|>user\n",
    "The quick brown fox jumps over the lazy dog; the lazy dog sleeps on, undisturbed, "
    "while 3 hens count 1234 grains of corn.\n\n",
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n",
    "Ça va très bien, merci ! 漢字とかなを混ぜた文章です。🙂👍🏽 Grüße aus Köln...  ",
]
"""Long openings, so that later texts share enough with earlier ones to reuse."""


def long_texts() -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(PREAMBLES), texts(), texts()).map("".join)


@cache
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


@cache
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_files(
        {
            TOKENIZER_FILE: tiny_tokenizer_json(TINY_CONFIG.vocab_size),
            TOKENIZER_CONFIG_FILE: json.dumps(tiny_tokenizer_config()),
        }
    )


@cache
def bare_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer without its special tokens: "<|im_start|>" is plain text to it, so
    the text index backs off by a margin of 1 character and the split points that must follow
    a back-off point do all the work (with a margin of 16 they are never needed)."""
    config = json.loads(smollm2_tokenizer().backend.to_str())
    config["added_tokens"] = []
    return Tokenizer.from_files({TOKENIZER_FILE: json.dumps(config)})


TOKENIZERS = {"smollm2": smollm2_tokenizer, "tiny": tiny_tokenizer}
WITH_BARE = {**TOKENIZERS, "bare": bare_tokenizer}
