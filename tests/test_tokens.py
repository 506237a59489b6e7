"""One token display everywhere (issue 27 item 7): decoded text with visible whitespace, never raw BPE."""

from __future__ import annotations

import copy
import re

import pytest
from transformers import AutoTokenizer

import interp
from interp.model.bundled import bundled_folder
from interp.tokens.display import display_tokens, visible

TEXT = "He said “hi”\u00a0there\n\tok"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(bundled_folder("smollm2"), local_files_only=True)


def test_byte_level_bpe_is_decoded_with_visible_spaces(smollm2_tokenizer):
    ids = smollm2_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    raw = smollm2_tokenizer.convert_ids_to_tokens(ids)
    assert "ĠâĢľ" in raw and "Âł" in raw  # what the tables used to print
    shown = display_tokens(smollm2_tokenizer, ids)
    assert shown == ["He", "␣said", "␣“", "hi", "”", "␣", "there", "\\n", "\\t", "ok"]
    assert "".join(shown).replace("␣", " ").replace("\\n", "\n").replace("\\t", "\t") == TEXT.replace("\u00a0", " ")


def test_a_byte_level_decoder_inside_a_sequence_is_byte_level_too(smollm2_tokenizer):
    """transformers 5.17 converts SmolLM2's GGUF tokenizer with a Sequence(ByteFallback, Fuse, Replace, ByteLevel)
    decoder, 5.24 with a bare ByteLevel: both must decode the byte-level token strings."""
    from tokenizers import decoders

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                             decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert display_tokens(tokenizer, ids) == display_tokens(smollm2_tokenizer, ids)
    assert display_tokens(tokenizer, ids)[2] == "␣“"
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    assert display_tokens(tokenizer, ids)[2] == "␣âĢľ"  # no ByteLevel anywhere: the token strings as they are


def test_sentencepiece_and_byte_fallback_tokens():
    assert visible("▁said") == "␣said" and visible("<0x0A>") == "\\n" and visible("<0xC2>") == "<0xC2>"
    assert visible("<0xc2>") == "<0xC2>"  # one spelling of a byte that is no character, whatever the tokenizer's


def test_pieces_of_a_character_show_as_bytes_a_reader_knows(smollm2_tokenizer):
    """Random tokens of a byte-level vocabulary are often pieces of a character (313 of SmolLM2's 49,152): the
    report's labels showed Python escapes such as ``\\xe6\\x9d`` (issue 35). A piece shows as tokenizers write a
    byte-fallback token, ``<0xE6><0x9D>``, whole characters in the same token decoded; the views' labels too."""
    from types import SimpleNamespace

    from analyses.views.common import model_tokens

    ids = smollm2_tokenizer("a杀b 東京 😀", add_special_tokens=False)["input_ids"]
    assert smollm2_tokenizer.convert_ids_to_tokens(ids)[1:3] == ["æĿ", "Ģ"]
    shown = display_tokens(smollm2_tokenizer, ids)
    assert shown[:3] == ["a", "<0xE6><0x9D>", "<0x80>"] and "<0xE4><0xBA>" in shown
    assert not any("\\x" in t for t in shown) and model_tokens(SimpleNamespace(tokenizer=smollm2_tokenizer), ids) == shown
    everything = display_tokens(smollm2_tokenizer, range(len(smollm2_tokenizer)))
    assert not any("\\x" in t for t in everything)
    pieces = [t for t in everything if "<0x" in t]
    assert 300 <= len(pieces) <= 330 and all(re.fullmatch(r"(.*?)((<0x[8-9A-F][0-9A-F]>)+)(.*?)", t) for t in pieces)


def test_logit_lens_and_views_show_the_display_form():
    from analyses import logit_lens
    from analyses.views.attention import model_tokens

    model = interp.load_model("smollm2")
    tokens = model.to_batch(["The cat sat on the mat. The cat"])
    lens = logit_lens(model, tokens, k=3)
    shown = [t for row in lens["top_tokens"] for t in row]
    assert shown and not any("Ġ" in t or "Ċ" in t for t in shown)
    assert "␣cat" in model_tokens(model, tokens["input_ids"][0])
