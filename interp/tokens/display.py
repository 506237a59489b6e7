"""One display of tokens everywhere (tables, the logit lens, views, plots): the token's text as a person reads it,
with whitespace made visible.

Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2) store each byte as a printable stand-in (``Ġ`` a space, ``Ċ`` a
newline, ``âĢľ`` the three bytes of ``“``); they are mapped back to the bytes and decoded. SentencePiece's ``▁`` and
any space show as ``␣``, newlines as ``\\n``, tabs as ``\\t``. A byte that is not a character on its own (a piece of a
character a tokenizer split, common among random tokens: ``æĿ`` is the first two of the three bytes of ``杀``) shows
as tokenizers write a byte-fallback token, ``<0xE6><0x9D>``, never as Python's escapes ``\\xe6\\x9d``; a byte-fallback
token ``<0xNN>`` shows as its character where it is one (``<0x0A>``: ``\\n``), else as it is.

>>> visible("Ġsaid"), visible("▁said"), visible(" said\\n")
('␣said', '␣said', '␣said\\\\n')
"""

from __future__ import annotations

import json
import re
from functools import cache

__all__ = ["display_tokens", "readable_tokens", "visible"]

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's): printable Latin-1 bytes stand for
    themselves, the others are shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {b: b for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in table.items()}


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's, alone or inside a ``Sequence`` (transformers 5.17 builds
    ``Sequence([ByteFallback, Fuse, Replace, ByteLevel])`` for a GGUF Llama-style BPE, where 5.24 builds
    ``ByteLevel``)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:  # a tokenizers component's pickled state is its JSON
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):  # no backend tokenizer or no decoder
        return False
    return any(part.get("type") == "ByteLevel" for part in [spec, *spec.get("decoders", ())] if isinstance(part, dict))


def _from_bytes(token: str) -> str:
    decoder = _byte_decoder()
    if not all(c in decoder for c in token):  # added tokens are kept as they were written
        return token
    return _utf8(bytes(decoder[c] for c in token))


def _utf8(data: bytes) -> str:
    """``data`` decoded as UTF-8, each byte that is no part of a whole character as ``<0xNN>``."""
    shown = []
    while data:
        try:
            shown.append(data.decode("utf-8"))
            break
        except UnicodeDecodeError as err:
            shown.append(data[:err.start].decode("utf-8") + "".join(f"<0x{b:02X}>" for b in data[err.start:err.end]))
            data = data[err.end:]
    return "".join(shown)


def visible(token: str) -> str:
    """A token string with its whitespace visible: spaces (and ``Ġ``, ``▁``) as ``␣``, newlines (and ``Ċ``) as ``\\n``,
    tabs as ``\\t``; a byte-fallback token ``<0xNN>`` as its character, or as it is where the byte is no character."""
    token = str(token)
    byte = _BYTE_TOKEN.match(token)
    if byte:
        value = int(byte.group(1), 16)
        token = chr(value) if value < 0x80 else f"<0x{value:02X}>"
    for raw, shown in ((" ", "␣"), ("\u00a0", "␣"), ("Ġ", "␣"), ("▁", "␣"), ("\n", "\\n"), ("Ċ", "\\n"),
                       ("\t", "\\t"), ("ĉ", "\\t")):
        token = token.replace(raw, shown)
    return token


def display_tokens(tokenizer, ids) -> list[str]:
    """The display form (``visible``) of each token of ``ids``: decoded text for byte-level BPE, else the tokenizer's
    own token strings."""
    tokens = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    if _byte_level(tokenizer):
        return [visible(_from_bytes(t)) for t in tokens]
    return [visible(t) for t in tokens]


def readable_tokens(tokenizer, ids) -> list[str]:
    """Each token of ``ids`` as the text it stands for (TransformerLens's ``to_str_tokens``): ``' cat'``, never
    ``'Ġcat'`` or ``'▁cat'``; a byte-fallback token ``<0xNN>`` as its character, or ``\\xNN`` when it is not one on
    its own, as are the bytes of an incomplete character."""
    tokens = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    if _byte_level(tokenizer):
        return [_from_bytes(t) for t in tokens]
    out = []
    for token in map(str, tokens):
        byte = _BYTE_TOKEN.match(token)
        if byte:
            value = int(byte.group(1), 16)
            token = chr(value) if value < 0x80 else f"\\x{value:02x}"
        out.append(token.replace("\u2581", " "))
    return out
