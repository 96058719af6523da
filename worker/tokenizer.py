"""Text <-> token ids for one checkpoint: encode, decode, stream-decode, render chat templates.

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a checkpoint directory's tokenizer.json
and reads tokenizer_config.json (special tokens, chat template). `IncrementalDecoder` turns a
stream of generated ids into text deltas whose concatenation is exactly `decode(all ids)`, never
emitting half a UTF-8 character. Chat templates are Jinja, rendered in a sandbox the way
transformers renders them. Nothing here touches the network or knows about models or engines.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as BackendTokenizer

from worker.fill_in_middle import fim_tokens

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"
"""Where a vision-language checkpoint's processor keeps its template (SmolVLM's)."""
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    PROCESSOR_CHAT_TEMPLATE_FILE,
    "config.json",
    "generation_config.json",
)
"""Everything `Tokenizer.from_dir` reads: what a process without the checkpoint needs."""
REPLACEMENT_CHAR = "\ufffd"
"""What a decoder yields for bytes that are not (yet) a whole UTF-8 character."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or ids it cannot decode; the message says which."""


class ChatTemplateError(TokenizerError):
    """A chat request that cannot be rendered: no template, bad messages, or a refusing template."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as text or as `{"content": text, ...}`."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(raw: Any) -> list[int]:
    if isinstance(raw, list):
        return [int(i) for i in raw]
    return [] if raw is None else [int(raw)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise TokenizerError(f"{path} is not valid JSON: {error}") from error
    return data if isinstance(data, dict) else {}


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / CHAT_TEMPLATE_FILE).is_file():
        template = (path / CHAT_TEMPLATE_FILE).read_text()
    if template is None:  # {"chat_template": "..."}, as a processor saves it
        template = _read_json(path / PROCESSOR_CHAT_TEMPLATE_FILE).get("chat_template")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's tojson escapes HTML characters; templates expect plain JSON (as in transformers).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def tokenizer_files(path: Path) -> dict[str, str]:
    """The tokenizer files of a checkpoint directory, by name (for `Tokenizer.from_files`)."""
    return {
        name: (Path(path) / name).read_text()
        for name in TOKENIZER_FILES
        if (Path(path) / name).is_file()
    }


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox with the helpers transformers gives templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error


class Tokenizer:
    """One checkpoint's tokenizer: ids, special tokens, streaming decode and chat rendering."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        template_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template_tokens = dict(template_tokens or {})
        self._template_tokens.update(bos_token=bos_token, eos_token=eos_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(bos_token)
        eos = [self._id_of(eos_token), *extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in added.items() if token.special
        )
        self.fim_tokens = fim_tokens({token.content: i for i, token in added.items()})
        """The model's fill-in-the-middle tokens (None: it has none; worker/fill_in_middle.py)."""

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json and tokenizer_config.json; stop ids also come from config.json and
        generation_config.json when the directory has them."""
        path = Path(path)
        tokenizer_path = path / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise TokenizerError(f"{tokenizer_path} is missing: a checkpoint needs tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as error:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"{tokenizer_path} cannot be loaded: {error}") from error
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        extra = _eos_ids(_read_json(path / "config.json").get("eos_token_id"))
        extra += _eos_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            extra_eos_token_ids=extra,
            chat_template=_chat_template(path, config),
            template_tokens={
                f"{name}_token": _token_text(config.get(f"{name}_token")) for name in ("unk", "pad")
            },
        )

    @classmethod
    def from_files(cls, files: Mapping[str, str]) -> Tokenizer:
        """Load from `tokenizer_files(...)` sent by another process (the router has no copy of
        the checkpoint); names other than `TOKENIZER_FILES` are refused."""
        unknown = sorted(set(files) - set(TOKENIZER_FILES))
        if unknown:
            raise TokenizerError(f"not tokenizer files: {unknown}")
        with tempfile.TemporaryDirectory(prefix="radixmesh-tokenizer-") as folder:
            for name, text in files.items():
                (Path(folder) / name).write_text(text)
            return cls.from_dir(Path(folder))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Encode a rendered chat prompt with `add_special_tokens=False`:
        the template already wrote whatever BOS the model wants.

        Through `encode_batch_fast`: it releases the GIL while it works (`encode` holds it: a
        1 MB text stalled every other thread 0.5 s), and it computes no character offsets, which
        halves the time and makes the result cheap to free (freeing it holds the GIL: 26 ms
        with offsets, 4.5 ms without, for 207k tokens). The ids are the same."""
        (encoding,) = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def encode_with_offsets(self, text: str) -> Encoding:
        """`text`'s encoding with no special tokens added, with each token's character offsets
        and pre-tokenizer word (what the router's text index needs; about 20 % slower than
        `encode`). Releases the GIL like `encode`."""
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=False)
        return encoding

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}) "
                f"({len(bad)} such id(s))"
            )
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template (tokenizer_config.json `chat_template` or "
                "chat_template.jinja); send a plain prompt instead of chat messages"
            )
        return compile_chat_template(self.chat_template)

    @cached_property
    def renders_tools(self) -> bool:
        """The chat template reads the `tools` variable (Qwen's, Llama 3.1's, Hermes's, ...);
        False for one that does not, or for no template."""
        if self.chat_template is None:
            return False
        env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
        try:
            parsed = env.parse(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation with the checkpoint's template (as transformers does, untokenised).

        `extra` reaches the template as variables (`tools`, `documents`, `enable_thinking`, ...).
        """
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"message {index} needs a string 'role': got {message!r}")
        template = self._compiled_template
        variables = {"tools": None, "documents": None, **self._template_tokens, **extra}
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"the chat template refused the messages: {error}") from error


class IncrementalDecoder:
    """Feed generated ids one at a time; get the text each one completes.

    Two offsets into the ids, as vLLM and TGI keep them: `prefix` starts a short window whose text
    has already been emitted up to `read`. Each step decodes the window with and without the new
    ids and emits the difference, unless it ends in U+FFFD: a multi-byte character whose remaining
    bytes are still to come is held back until they arrive. `finish()` flushes whatever is held
    (a stream cut inside a character ends in U+FFFD, as `decode` of all the ids does).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self.text = ""
        """Everything emitted so far."""

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, new_text: str) -> str:
        """Emit the window's text past what was emitted; the window then starts at `read`."""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self.text += delta
        return delta

    def step(self, token_id: int) -> str:
        """The text completed by `token_id` (often "", e.g. inside a multi-byte character)."""
        return self.extend([token_id])

    def extend(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def finish(self) -> str:
        """Whatever is still held back; afterwards `text == decode(ids)`."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids[self._prefix :]))
