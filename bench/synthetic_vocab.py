"""A model directory whose tokenizer has a full-size vocabulary, for `duet bench-masks --vocab N
--masks-only`: the cost of a grammar mask grows with the vocabulary (llguidance walks a trie of
every token), and the built-in and bench models have ~2 k real tokens where DeepSeek's have
129 280. No real tokenizer can be downloaded here, so this one is a byte-level BPE trained to N
tokens on random text: a lexicon of random words (85 % Latin letters, 15 % CJK characters, the
multi-byte tokens a real vocabulary is full of) drawn into lines. Its tokens are the lexicon's
words and their pieces, the shape of a real BPE vocabulary, not its contents: the figure it gives
is a mask cost at that size, not DeepSeek's exact one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
LEXICON, LINES, WORDS_PER_LINE = 160_000, 300_000, 12


def synthetic_vocab_model(
    vocab_size: int, out: Path, like: Path, seed: int = 0, num_lines: int = LINES
) -> Path:
    """`out` holding a tokenizer.json of `vocab_size` tokens (trained on `num_lines` lines) and
    `like`'s config.json with that vocabulary (the masks read only these two)."""
    from tinymodel.builder import EOS, bpe_tokenizer

    rng = random.Random(seed)

    def word() -> str:
        if rng.random() < 0.15:
            return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 3)))
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10)))

    lexicon = [word() for _ in range(LEXICON)]
    lines = [
        " ".join(rng.choice(lexicon) for _ in range(WORDS_PER_LINE)) + "\n"
        for _ in range(num_lines)
    ]
    lines += [" ".join(lexicon[i : i + WORDS_PER_LINE]) + "\n" for i in range(0, LEXICON, 12)] * 2
    tok = bpe_tokenizer(lines, vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the text yields {tok.get_vocab_size()} tokens, not {vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((like / "config.json").read_text())
    config.update(vocab_size=vocab_size, eos_token_id=tok.token_to_id(EOS))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    return out
