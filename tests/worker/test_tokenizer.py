"""worker.tokenizer: ids, special tokens, streaming decode that never takes text back, chat."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from worker.tiny_model import build_tiny_checkpoint
from worker.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

TEXTS = [
    "The capital of France is Paris.",
    "Grüße aus München! Ça va très bien. naïve café",
    "你好，世界。こんにちは世界。안녕하세요 🙂🚀✓→∑π 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tend",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def test_special_tokens_and_sizes(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 512
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.special_token_ids == {0, 1, 2}
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tokenizer.decode(ids, skip_special_tokens=True) == plain


def test_out_of_vocabulary_ids_are_named(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        tokenizer.decode([5, 512, 7])
    with pytest.raises(TokenizerError, match="token id -1"):
        tokenizer.decode([-1])


def _stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip)
    final = tokenizer.decode(ids, skip_special_tokens=skip)
    deltas = []
    for token_id in ids:
        deltas.append(decoder.step(token_id))
        # Emitted text is never taken back: it is always the start of the final text.
        assert final.startswith(decoder.text)
    deltas.append(decoder.finish())
    assert decoder.text == "".join(deltas)
    return deltas, final


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_real_text_never_emits_half_characters(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not text.isascii():  # some token holds only part of a character: the case under test
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, final = _stream(tokenizer, ids, skip=False)
    assert "".join(deltas) == final == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing was left held back


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_random_ids_equals_full_decode(tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    byte_tokens = [
        i for i in range(tokenizer.vocab_size) if len(tokenizer.id_to_token(i) or "") == 1
    ]
    for trial in range(60):
        pool = byte_tokens if trial % 2 else range(tokenizer.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        deltas, final = _stream(tokenizer, ids, skip)
        assert "".join(deltas) == final


def test_stream_cut_inside_a_character_flushes_on_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    emitted = "".join(decoder.step(i) for i in ids[:-1])
    assert emitted == "ok"  # " " shares a token with the emoji's first byte: both held back
    assert decoder.finish() == " \ufffd"
    assert decoder.text == tokenizer.decode(ids[:-1])


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without.endswith("France?<|im_end|>\n")


def _with_template(tiny_dir: Path, tmp_path: Path, template: str | None) -> Tokenizer:
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_template_helpers_match_transformers_conventions(tiny_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{% if tools is none %}|no tools{% endif %}"
        "{% if messages | length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}"
    )
    tokenizer = _with_template(tiny_dir, tmp_path, template)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é<b>"}]) == (
        '<|im_start|>"é<b>"4|no tools'
    )
    with pytest.raises(ChatTemplateError, match="at most two messages"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}] * 3)


def test_trim_and_lstrip_blocks(tiny_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n    {% if true %}\n[{{ m['role'] }}]\n    {% endif %}\n"
        "{% endfor %}"
    )
    tokenizer = _with_template(tiny_dir, tmp_path, template)
    assert tokenizer.apply_chat_template([{"role": "a"}, {"role": "b"}]) == "[a]\n[b]\n"


def test_no_template_is_a_clear_error(tiny_dir: Path, tmp_path: Path) -> None:
    tokenizer = _with_template(tiny_dir, tmp_path, None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert (
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "u", "content": "hi"}]) == "hi!"
    )


def test_bad_messages_and_bad_templates(
    tokenizer: Tokenizer, tiny_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ChatTemplateError, match="message 1 needs a string 'role'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    broken = _with_template(tiny_dir, tmp_path, "{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "a"}])


def test_sandbox_blocks_python_internals(tiny_dir: Path, tmp_path: Path) -> None:
    tokenizer = _with_template(tiny_dir, tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}])


def test_stop_ids_gather_config_and_generation_config(tiny_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (2, 0)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_a_json_file_that_is_not_utf8_is_named(tiny_dir: Path, tmp_path: Path, name: str) -> None:
    """A tokenizer's JSON file holding bytes that are not UTF-8 is a TokenizerError naming the
    file, as invalid JSON is: before, a bare UnicodeDecodeError named no file."""
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((tiny_dir / file).read_bytes())
    (tmp_path / name).write_bytes(b"\xff\xfe{}")
    with pytest.raises(TokenizerError, match=f"{re.escape(str(tmp_path / name))} is not valid"):
        Tokenizer.from_dir(tmp_path)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        Tokenizer.from_dir(tmp_path)
