"""Fill-in-the-middle (FIM) prompts: `suffix` on `/v1/completions`, the way DeepSeek models do it.

A completion with a `suffix` asks the model for the text between the prompt and the suffix (code
completion in an editor: the code before the cursor, the code after it). DeepSeek's tokenizers
hold three tokens for this, and the model was trained on prompts of the form

    <｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>

after which it writes the middle. SGLang picks such a completion template per model name; here
the model's tokenizer decides: a model has FIM when its tokenizer holds all three tokens, so no
table of model names is needed, and a model without them gets a clear refusal instead of a
prompt it was never trained on.

The FIM tokens go in as their single ids, never re-tokenized from their text; the prompt and the
suffix are encoded without special tokens, and bos comes first exactly as for a plain prompt
(`add_special_tokens` and a tokenizer that adds one). Torch-free: the router builds these ids.
"""

from __future__ import annotations

from typing import NamedTuple

from control.errors import InvalidRequestError
from control.tokenizer import Tokenizer

# The fullwidth bars are U+FF5C, the "▁" U+2581: DeepSeek's spelling, exactly.
FIM_BEGIN = "<\uff5cfim\u2581begin\uff5c>"
FIM_HOLE = "<\uff5cfim\u2581hole\uff5c>"
FIM_END = "<\uff5cfim\u2581end\uff5c>"
FIM_TOKENS = (FIM_BEGIN, FIM_HOLE, FIM_END)


class NoFimTokensError(InvalidRequestError):
    """A suffix was given, but the model's tokenizer lacks the FIM tokens (a 400 on `suffix`)."""


class FimTokenIds(NamedTuple):
    begin: int
    hole: int
    end: int


def fim_token_ids(tokenizer: Tokenizer) -> FimTokenIds | None:
    """The ids of the three FIM tokens, or None when the tokenizer lacks any of them."""
    ids = [tokenizer.token_to_id(token) for token in FIM_TOKENS]
    if any(token_id is None for token_id in ids):
        return None
    return FimTokenIds(*ids)


def fim_prompt_ids(
    tokenizer: Tokenizer, prompt: str, suffix: str, add_special_tokens: bool = True
) -> list[int]:
    """The ids of `<｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>`, bos first when
    `add_special_tokens` and the tokenizer adds one. NoFimTokensError for a model without FIM."""
    fim = fim_token_ids(tokenizer)
    if fim is None:
        raise NoFimTokensError(
            f"suffix: this model has no fill-in-the-middle tokens ({', '.join(FIM_TOKENS)})"
        )
    bos = [tokenizer.bos_token_id] if add_special_tokens and tokenizer.add_bos_token else []
    return [
        *bos,
        fim.begin,
        *tokenizer.encode(prompt),
        fim.hole,
        *tokenizer.encode(suffix),
        fim.end,
    ]
