"""Byte-level BPE, trained on the corpus with Hugging Face `tokenizers` (the GPT-2 recipe).

Byte-level: any UTF-8 text round-trips exactly and nothing is unknown; merges make common words one token.

The recipe: the GPT-2 regex splits text into words, punctuation and whitespace runs; every byte
is mapped to one of 256 printable symbols (the initial alphabet, so all 256 are in the vocabulary
even if the corpus never uses some); then merges of the most frequent adjacent pairs fill the
vocabulary up to `vocab_size`. One special token, `<|endoftext|>`, separates documents.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
# Part of the token cache key: bump it when the recipe below changes.
TOKENIZER_ALGORITHM = "bytelevel-bpe-gpt2regex-v1"
_MIN_VOCAB = 256 + 1  # the byte alphabet plus EOT


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with at most `vocab_size` tokens (exactly that many on a large enough corpus).

    Ids are < vocab_size, so they index the model's embedding table directly. A small corpus
    can run out of pairs to merge before the vocabulary is full; the table then has unused rows.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (>= {_MIN_VOCAB})")
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: the text round-trips exactly, and " the" and "the" stay different tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first, so EOT is id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Pieces rather than whole documents: the same words are counted, on all cores.
    pieces = (piece for text in texts for piece in split_for_encoding(text))
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    assert actual <= vocab_size, f"tokenizer has {actual} tokens, more than vocab_size={vocab_size}"
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    return token_id


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids for `text`, with no special tokens added around it."""
    return tokenizer.encode(text, add_special_tokens=False).ids


# A line start that follows a non-blank line ending in a non-space character, and starts with
# one: the GPT-2 regex always splits the text there, so cutting a document at such points and
# encoding the pieces gives exactly the ids of encoding it whole (a test checks this).
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_PIECE_CHARS = 16384


def split_for_encoding(text: str, piece_chars: int = _PIECE_CHARS) -> list[str]:
    """`text` cut at pre-token boundaries into pieces of about `piece_chars` characters.

    `tokenizers` parallelises a batch across texts but encodes one text on one core, so a few
    long documents would leave cores idle; pieces of ~16 KB keep all of them busy.
    """
    pieces, start = [], 0
    while start + piece_chars < len(text):
        cut = _SAFE_CUT.search(text, start + piece_chars)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids for many texts at once, in parallel. A literal "<|endoftext|>" inside a text is encoded
    as ordinary characters, so only the separators we insert ourselves mean "new document"."""
    pieces = [split_for_encoding(text) for text in texts]
    # encode_batch_fast (tokenizers >= 0.20) skips computing character offsets: ~2x faster.
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encodings = encode_batch([piece for doc in pieces for piece in doc], add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = previous
    documents, next_piece = [], 0
    for doc in pieces:
        documents.append([i for encoding in encodings[next_piece:next_piece + len(doc)] for i in encoding.ids])
        next_piece += len(doc)
    return documents


def decode(tokenizer: Tokenizer, ids: Iterable[int]) -> str:
    """Text for `ids`, keeping EOT visible (it separates documents)."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
