"""The most characters of input text one token of a tokenizer can stand for, read from its definition.

A prompt whose document has more than that many characters per token it may hold cannot fit, so the
prompt builder (batchgen.jobs.prompting.prompts) cuts such a document to a prefix before tokenizing it:
tokenizing a whole 24 MB cell, then again with character offsets, cost gigabytes for a prompt of a
few hundred tokens. The bound must hold for every text, or a prompt that fits would be cut, so it is
given only where the tokenizer's definition proves it:

- every character of the text ends up in some token: no normalizer or pre-tokenizer that drops
  characters (Strip, StripAccents, BERT's cleaning, whitespace splitting, a Replace by nothing, a
  Split that removes its matches), and no unknown token that a run of unknown characters fuses into;
- a token's own string is at least as long as the text it covers: byte-level tokens hold one
  character per byte, SentencePiece's hold "▁" for a space, a byte-fallback token "<0xE2>" covers
  one byte; so the longest vocabulary or added-token string bounds one token's text after
  normalization;
- a normalizer that shortens text shortens it by a bounded factor: canonical composition (NFC, NFKC)
  joins at most 4 characters into one, and a Replace of a string by a shorter one by their ratio.

Anything else (a slow tokenizer, an unknown component) gives None: no bound, every prompt is
tokenized whole, as before.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

# the most characters canonical composition joins into one (e.g. U+1F82 from alpha and three marks)
_COMPOSITION_CHARS = 4
_KEEPING_NORMALIZERS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1,
                        "NFC": _COMPOSITION_CHARS, "NFKC": _COMPOSITION_CHARS}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
# per tokenizer: reading it walks its whole definition, and a job builds prompts for run, resume and plan
_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token covers for this (HF) tokenizer; None when unknown."""
    try:
        size = len(tokenizer)  # tokens added later: read it again
    except TypeError:
        size = None
    try:
        cached_size, bound = _BOUNDS[tokenizer]
        if cached_size == size:
            return bound
    except (KeyError, TypeError):  # TypeError: an object that takes no weak reference
        pass
    bound = _read_bound(tokenizer)
    try:
        _BOUNDS[tokenizer] = (size, bound)
    except TypeError:
        pass
    return bound


def _read_bound(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    longest = _longest_token(spec)
    factor = _normalizer_factor(spec.get("normalizer"))
    if longest is None or factor is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    return max(1, longest) * factor


def _longest_token(spec: dict) -> int | None:
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk"):
            return None  # a run of unknown characters of any length becomes one token
        pieces = list(model.get("vocab") or {})
    elif kind == "Unigram":
        if not model.get("byte_fallback"):
            return None  # unknown characters become an unknown token, runs of them fused
        pieces = [piece for piece, _score in model.get("vocab") or []]
    else:  # WordPiece and WordLevel map whole words to one unknown token
        return None
    pieces += [added.get("content", "") for added in spec.get("added_tokens") or []]
    return max(map(len, pieces), default=0)


def _normalizer_factor(normalizer: dict | None) -> int | None:
    """How many characters of input one normalized character can stand for; None when unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or []:
            part_factor = _normalizer_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if "String" not in pattern or not content:
            return None  # a regex can match runs of any length; an empty content deletes
        return max(1, math.ceil(len(pattern["String"]) / len(content)))
    return _KEEPING_NORMALIZERS.get(kind)


def _keeps_characters(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in pre_tokenizer.get("pretokenizers") or [])
    if kind == "Split" and pre_tokenizer.get("behavior") == "Removed":
        return False
    return kind in _KEEPING_PRE_TOKENIZERS
