"""Write the default model's tokenizer (SmolLM2-135M-Instruct, from its GGUF) as a Hugging Face
tokenizer directory, for benchmark clients that count tokens themselves (aiperf, guidellm) on a
machine without hub access.

Run: `python benchmarks/export_tokenizer.py DIR`. Only the GGUF's metadata is read; the files are
the ones the workers build (worker/gguf_checkpoint.py), plus a config.json naming the model type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf

from worker.default_model import default_gguf_path
from worker.gguf_checkpoint import build_tokenizer, read_metadata, tokenizer_config


def export(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    meta = read_metadata(gguf.GGUFReader(default_gguf_path()))
    tokenizer = build_tokenizer(meta)
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "max_position_embeddings": int(meta.get("llama.context_length", 8192)),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/export_tokenizer.py DIR")
    print(export(Path(sys.argv[1])))
