"""The trained tiny model's text and tokenizer: the Python standard library's own source.

Every machine with Python has it, so the tiny model trains without a download. The selection is
fixed (the stdlib's top-level modules, sorted by name, none over 200 KB); every tenth file is
held out for evaluation. The bytes differ between Python versions, so the tiny model's cache key
(`tinymodel.builder`) hashes them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from tinymodel.builder import bpe_tokenizer

# Sub-packages are skipped (top-level modules only), these names included should that change.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
MAX_FILE_BYTES = 200_000
HELD_OUT_EVERY = 10  # file i is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
TRAINED_VOCAB = 2048  # BPE target; the model's embedding is padded to a multiple of 64


@dataclass(frozen=True)
class Corpus:
    """The stdlib text, split by file: `train` for the tokenizer and the weights, `held_out`
    for evaluation only."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]
    digest: str  # sha256 of every selected file's name and bytes, in order


def stdlib_files() -> list[Path]:
    """The fixed selection: top-level `*.py` of the stdlib, sorted, each at most 200 KB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.glob("*.py")):
        if SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            files.append(path)
    return files


def load_corpus() -> Corpus:
    train, held_out = [], []
    digest = hashlib.sha256()
    for i, path in enumerate(stdlib_files()):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data + b"\0")
        text = data.decode("utf-8", errors="replace")
        (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(text)
    if not train or not held_out:
        raise RuntimeError("the Python standard library's sources were not found")
    return Corpus(tuple(train), tuple(held_out), digest.hexdigest())


def train_code_tokenizer(corpus: Corpus, extra_text: str, vocab_size: int = TRAINED_VOCAB):
    """Byte-level BPE on the training files plus `extra_text` (the random model's corpus, which
    keeps multi-byte characters and plain English in the vocabulary); the same setup as
    `tinymodel.builder.train_tokenizer`."""

    lines = list(extra_text.splitlines(keepends=True))
    for text in corpus.train:
        lines.extend(text.splitlines(keepends=True))
    return bpe_tokenizer(lines, vocab_size)


def encode_files(tok, texts: tuple[str, ...], eos_id: int) -> torch.Tensor:
    """One int64 stream: each file's tokens followed by EOS (no BOS: samples get their own)."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, length: int, bos_id: int) -> torch.Tensor:
    """[N, length + 1]: BOS then `length` consecutive tokens of the stream, non-overlapping, so
    every sample starts the way a prompt does (`encode_prompt` adds BOS)."""
    n = stream.numel() // length
    body = stream[: n * length].view(n, length)
    return torch.cat((torch.full((n, 1), bos_id, dtype=torch.int64), body), dim=1)
