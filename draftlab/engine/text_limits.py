"""A prompt text too long for the context, refused before it is tokenized whole.

Tokenizing is the slow part of a huge request: 10 MiB of text took 24 s on the embedded target's
tokenizer (a 2-core CPU) before its 400 came back. Two bounds refuse such a text in milliseconds:

1. Bytes. Every token stands for at most `max_token_bytes` bytes of text (the longest vocabulary
   entry, UTF-8 encoded, which is at least the bytes it stands for in byte-level BPE, SentencePiece
   and WordPiece vocabularies), so a text of more than context x max_token_bytes bytes cannot fit.
   A factor of 2 allows for normalizers that shorten text (Unicode composition).
2. A prefix. For a long context the byte bound is loose, so growing prefixes of the text are
   tokenized first, each cut at whitespace: the pre-tokenizers of chat models split words at
   whitespace, so the prefix's tokens are the whole text's first tokens, and a prefix that alone
   overflows the context refuses the text after tokenizing a few times the context's worth of it.

A text that passes both is tokenized whole and checked exactly (draftlab.engine.runners.Engine.check_request).
Measured on the embedded target's tokenizer (longest entry 13 bytes), 2-core CPU: a 10 MiB text is
refused in 0.05-0.16 s at its 512-token context and at 131,072 (the byte bound). At a context of
1,000,000 tokens the prefixes refuse 10 MiB of words in about 11 s; 10 MiB without any whitespace
has no safe place to cut a prefix, so it is tokenized whole (33 s) before its 400.
"""
from __future__ import annotations

import re

from draftlab.engine.runners import ContextLengthError

FIRST_PROBE_CHARS = 16_384  # characters of the first prefix tokenized alone; each next one is 4x longer
NORMALIZER_SLACK = 2  # a normalizer may shorten text (NFC composition) by up to this factor
SPACE = re.compile(r"\s")


def max_token_bytes(tokenizer) -> int:
    """The longest vocabulary entry in UTF-8 bytes (at least 1)."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=1) or 1


def _space_before(text: str, end: int) -> int:
    """The index of the last whitespace character before `end`, or 0 when the prefix holds none."""
    for i in range(end - 1, max(end - 4096, 0) - 1, -1):  # a word longer than 4 KiB: no probe at this size
        if SPACE.match(text, i):
            return i
    return 0


def refuse_oversize(text: str, tokenizer, context: int, token_bytes: int, what: str) -> None:
    """ContextLengthError (the server's 400) when `text` cannot fit `context` tokens, decided from its
    length and from prefixes; returns when the whole text must be tokenized to tell."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > NORMALIZER_SLACK * context * token_bytes:
        raise ContextLengthError(f"The input ({what}: {size:,} bytes, more than {context} tokens at no more than {token_bytes} "
                                 f"bytes per token) is longer than the model's context length ({context} tokens).")
    end = FIRST_PROBE_CHARS
    while end < len(text):
        cut = _space_before(text, end)
        if cut:
            n = len(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
            if n > context:
                raise ContextLengthError(f"The input ({what}: at least {n} tokens in its first {cut:,} characters) is "
                                         f"longer than the model's context length ({context} tokens).")
        end *= 4
