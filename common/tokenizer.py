"""Text <-> token ids and chat prompts, read from a local Hugging Face tokenizer folder.

Uses the `tokenizers` library (tokenizer.json) and jinja2 directly; transformers is not
imported at runtime (it takes seconds to import). Encoding, decoding and chat rendering
match transformers' AutoTokenizer for the same folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to the printable character byte-level BPE spells it with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table, shifted = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenizerError(ValueError):
    """The tokenizer folder is unusable (the message names the missing file)."""


class ChatTemplateError(TokenizerError):
    """No chat template is available, or the template rejected the conversation."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """Special tokens are saved either as plain strings or as serialized AddedTokens."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # As in transformers, a separate chat_template.jinja wins over the config entry.
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` and renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A Hugging Face tokenizer folder: encode, decode, chat prompts and stop tokens.

    `eos_token_ids` is the config's eos token plus every eos id in generation_config.json.
    `vocab_size` counts every id the tokenizer can produce (added tokens included); the
    model's embedding table may be larger.
    """

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any], chat_template: str | None,
                 generation_config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self._add_missing_special_tokens(config)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self.special_tokens: dict[str, str] = {
            name: content
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(config.get(name))) is not None
        }
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        eos_ids = generation_config.get("eos_token_id")
        eos_ids = [] if eos_ids is None else [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids + ([eos_id] if eos_id is not None else []))
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_level = isinstance(tokenizer.decoder, ByteLevelDecoder)  # GPT-2's byte-to-character table
        # Normally tokenizer.json's post-processor adds BOS. Some older folders only say
        # add_bos_token in the config (transformers 4's Llama tokenizer honoured it).
        adds_bos = self.bos_token_id in tokenizer.encode("", add_special_tokens=True).ids
        self._prepend_bos = (
            bool(config.get("add_bos_token")) and self.bos_token_id is not None and not adds_bos
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {folder}; pass a Hugging Face model folder that has one "
                "(convert a .gguf file with common.model_source.resolve_model)"
            )
        config = _read_json(folder / "tokenizer_config.json")
        return cls(
            _HFTokenizer.from_file(str(tokenizer_file)),
            config,
            _chat_template(folder, config),
            _read_json(folder / "generation_config.json"),
        )

    def _add_missing_special_tokens(self, config: dict[str, Any]) -> None:
        # transformers adds special tokens that tokenizer_config.json lists but tokenizer.json lacks
        vocab = self._tok.get_vocab(with_added_tokens=True)
        listed = [entry for entry in config.get("added_tokens_decoder", {}).values() if entry.get("special")]
        for key in ("additional_special_tokens", "extra_special_tokens"):
            extra = config.get(key) or []
            listed += list(extra.values()) if isinstance(extra, dict) else extra  # a dict maps name -> token
        listed += [config.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")]
        missing = {c for t in listed if (c := _token_content(t)) is not None and c not in vocab}
        if missing:
            tokens = [AddedToken(c, special=True, normalized=False) for c in sorted(missing)]
            self._tok.add_special_tokens(tokens)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 byte sequences become U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token may be part of a character
        (its text alone is U+FFFD) and a byte-fallback token (`<0xF0>`) one byte of one;
        a client joins the pieces back into the character (OpenAI's logprobs `bytes`)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def tokens_of(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (transformers' convert_ids_to_tokens);
        None for an id outside it."""
        return [self._tok.id_to_token(i) for i in ids]

    @property
    def renders_tools(self) -> bool:
        """The chat template shows the model a `tools` list (tool-trained models' templates do)."""
        return self.chat_template is not None and re.search(r"\btools\b", self.chat_template) is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into one prompt string.

        The prompt already holds any BOS text the template writes: encode it with
        add_special_tokens=False. Raises ChatTemplateError when the folder has no template
        or the template rejects the conversation (e.g. roles that do not alternate).
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); use a completion prompt or an instruct model folder"
            )
        # As transformers does: a key whose value is None is dropped, so templates see it as undefined.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=messages, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
