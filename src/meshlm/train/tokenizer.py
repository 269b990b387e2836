"""Byte-level BPE, trained on the corpus with Hugging Face `tokenizers` (the GPT-2 recipe).

Byte-level: any UTF-8 text round-trips exactly and nothing is unknown; merges make common words one token.

The recipe: the GPT-2 regex splits text into words, punctuation and whitespace runs; every byte
is mapped to one of 256 printable symbols (the initial alphabet, so all 256 are in the vocabulary
even if the corpus never uses some); then merges of the most frequent adjacent pairs fill the
vocabulary up to `vocab_size`. One special token, `<|endoftext|>`, separates documents.

Or a pretrained tokenizer (`data.tokenizer`: a tokenizer.json, or a directory holding one, such
as a Hugging Face model's): used as it is; its end-of-text token separates documents.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.errors import ConfigError

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


def for_documents(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with no truncation and no padding, which it returns. A saved tokenizer.json may
    carry either (many Hugging Face tokenizers keep the model's max length or a pad length): applied
    to whole documents they would drop every token past max_length or insert pad ids into the token
    stream. meshlm encodes documents and windows them itself, so every load that encodes goes
    through here (the file itself is kept byte for byte: exports carry the user's settings)."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    return for_documents(Tokenizer.from_file(str(path)))


# --------------------------------------------------------------------------- pretrained

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # Hugging Face's, beside it: names the eos token
# Document separators of common tokenizers, tried in order when tokenizer_config.json names none.
END_OF_TEXT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")


def known_end_token(tokenizer: Tokenizer) -> tuple[str | None, int | None]:
    """(name, id) of the first of END_OF_TEXT_NAMES `tokenizer` has, or (None, None)."""
    for name in END_OF_TEXT_NAMES:
        if tokenizer.token_to_id(name) is not None:
            return name, tokenizer.token_to_id(name)
    return None, None


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A tokenizer the data is encoded with instead of a trained BPE (`data.tokenizer`)."""

    path: Path  # the tokenizer.json file
    sha256: str  # of that file: part of the token cache key
    n_ids: int  # one past the largest id: the model's vocab_size must be at least this
    end_token: str  # separates documents
    tokenizer: Tokenizer

    @property
    def end_id(self) -> int:
        return self.tokenizer.token_to_id(self.end_token)


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one inside a directory."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
        raise ConfigError(f"data.tokenizer: {where}")
    return file


def _named_end_token(file: Path) -> str | None:
    """The eos_token of the tokenizer_config.json beside `file`, as Hugging Face saves it."""
    config = file.parent / TOKENIZER_CONFIG
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves it, beside tokenizer.json


def chat_template(file: Path) -> str | list | None:
    """The chat template of the tokenizer.json `file`: the chat_template of the
    tokenizer_config.json beside it, else the chat_template.jinja beside it; None if neither.
    meshlm does not use it, but carries it (token cache, checkpoints, final/) into exports, so an
    export of a chat model fine-tuned with `model.init_from` still has its template."""
    try:
        template = json.loads((file.parent / TOKENIZER_CONFIG).read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if template is None and (file.parent / CHAT_TEMPLATE_FILE).is_file():
        template = (file.parent / CHAT_TEMPLATE_FILE).read_text()
    return template


def _end_token(tokenizer: Tokenizer, file: Path) -> str | None:
    """The token that separates documents: the eos_token of the tokenizer_config.json beside
    `file`, else the first of END_OF_TEXT_NAMES the tokenizer has (a Llama-3 chat tokenizer has
    both <|end_of_text|> and the <|eot_id|> its config names)."""
    for name in (_named_end_token(file), *END_OF_TEXT_NAMES):
        if name is not None and tokenizer.token_to_id(name) is not None:
            return name
    return None


def run_end_token(file: Path) -> tuple[str | None, int | None]:
    """(name, id) of the token a run separated documents with, from its tokenizer.json `file`
    (the token cache, checkpoints and final/ carry a pretrained tokenizer's config beside it)."""
    tokenizer = load_tokenizer(file)
    name = _end_token(tokenizer, Path(file))
    return name, None if name is None else tokenizer.token_to_id(name)


def load_pretrained(path: str | Path) -> PretrainedTokenizer:
    """The tokenizer `data.tokenizer` names; ConfigError (one line) if it cannot be used."""
    file = tokenizer_file(path)
    data = file.read_bytes()
    try:
        tokenizer = for_documents(Tokenizer.from_str(data.decode()))
    except Exception as e:  # tokenizers raises plain Exception on a bad file
        raise ConfigError(f"data.tokenizer: {file}: not a tokenizers JSON file ({e})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    end = _end_token(tokenizer, file)
    if end is None:
        raise ConfigError(f"data.tokenizer: {file} has no end-of-text token to separate documents "
                          f"(tried tokenizer_config.json's eos_token and {', '.join(END_OF_TEXT_NAMES)})")
    return PretrainedTokenizer(file, hashlib.sha256(data).hexdigest(), max(vocab.values()) + 1, end, tokenizer)


def splits_like_gpt2(tokenizer: Tokenizer) -> bool:
    """Whether cutting text at `split_for_encoding`'s points leaves the ids unchanged: true for
    meshlm's own recipe (a ByteLevel pre-tokenizer with the GPT-2 regex and no normaliser),
    not assumed for other tokenizers, which then encode each document whole."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False))


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    return token_id


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids for `text`, with no special tokens added around it."""
    return tokenizer.encode(text, add_special_tokens=False).ids


# Points where the GPT-2 regex always starts a pre-token, so cutting a document there and encoding
# the pieces gives exactly the ids of encoding it whole (tests check this on real text):
# - before a space that precedes a non-space: every alternative that can match there (` ?\p{L}+`,
#   ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`) takes that space, and a whitespace run before it ends
#   just before it (`\s+(?!\S)` backs off one character);
# - at a line start after a line ending in a non-space character, before a non-space character.
_SAFE_CUT = re.compile(r"(?= \S)|(?<=\S\n)(?=\S)")
_PIECE_CHARS = 16384
_FORCED_CUT_PIECES = 8  # no safe point for this many pieces: cut anyway, for bounded memory


def split_for_encoding(text: str, piece_chars: int = _PIECE_CHARS) -> list[str]:
    """`text` cut at pre-token boundaries into pieces of about `piece_chars` characters.

    `tokenizers` parallelises a batch across texts but encodes one text on one core, so a few
    long documents would leave cores idle; pieces of ~16 KB keep all of them busy. And its
    objects take ~100 bytes per token: pieces bound that too. Text with no safe point for
    `_FORCED_CUT_PIECES` pieces (minified code, one endless line) is cut after a newline, else
    anywhere: only there can the ids differ from encoding the text whole.
    """
    pieces, start = [], 0
    while start + piece_chars < len(text):
        limit = start + _FORCED_CUT_PIECES * piece_chars
        cut = _SAFE_CUT.search(text, start + piece_chars, limit)
        if cut is not None:
            end = cut.start()
        elif limit >= len(text):
            break
        else:
            end = text.rfind("\n", start + piece_chars, limit) + 1 or limit
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def encode_documents(tokenizer: Tokenizer, texts: list[str], split: bool = True) -> list[list[int]]:
    """Ids for many texts at once, in parallel. A literal "<|endoftext|>" inside a text is encoded
    as ordinary characters, so only the separators we insert ourselves mean "new document".
    `split`: cut long texts into pieces first (only for tokenizers where that changes nothing)."""
    for_documents(tokenizer)  # every token of every document, no pad ids
    pieces = [split_for_encoding(text) if split else [text] for text in texts]
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
