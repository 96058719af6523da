"""A thinking model for tests: the tiny checkpoint with a chat template that opens `<think>`
for the model (DeepSeek-R1's and Qwen3.5's way), closes it when `enable_thinking` is false
(Qwen3's switch), or leaves it to the model with `model_opens` (Qwen3's first template); it
strips the reasoning from an earlier answer's text and writes a turn's `reasoning_content`
back, as Qwen3's does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from worker.loader import LoadedModel, load_model

THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}"
    "{{ '<|im_start|>system\\nEffort: ' + reasoning_effort + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' %}{% set content = content.split('</think>')[-1] %}"
    "{% if message.reasoning_content %}"
    "{% set content = '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' + content %}"
    "{% endif %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% elif not (model_opens is defined and model_opens) %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)


def thinking_checkpoint(tiny: LoadedModel, path: Path) -> Path:
    """The tiny checkpoint's files, its chat template the thinking one."""
    shutil.copytree(tiny.path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


def thinking_model(tiny: LoadedModel, path: Path) -> LoadedModel:
    return load_model(thinking_checkpoint(tiny, path))
