"""Tokenizer of a model directory (`tokenizer.json` + `tokenizer_config.json`) and the
incremental detokenizer used to stream text.

The `tokenizers` library does the encoding; the chat template is rendered with a sandboxed jinja2
environment set up like transformers' (same variables, `raise_exception`, trim/lstrip blocks), so
a model's own template works unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from control.errors import ConfigError

REPLACEMENT_CHAR = "\ufffd"


def _token_content(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": ...} (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot parse ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return data


class Tokenizer:
    """Encodes prompts and chats, decodes ids; loaded from a Hugging Face model directory.

    Attributes:
        bos_token_id: id of the bos token, or None.
        eos_token_ids: ids that end generation (tokenizer eos, plus generation_config's).
        vocab_size: number of ids, added tokens included (may be below the model's padded vocab).
        add_bos_token: whether `encode_prompt` prepends bos.
    """

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ConfigError(f"{model_dir}: no tokenizer.json in the model directory")
        try:
            self._tok = HfTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise ConfigError(f"{tok_path}: cannot load tokenizer ({exc})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}

        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token, cfg_path)
        self.add_bos_token = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_ids = [] if self.eos_token is None else [self._id_of(self.eos_token, cfg_path)]
        eos_ids += self._generation_eos(model_dir)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = self._chat_template(model_dir, cfg)
        self._compiled_template = None

    def _id_of(self, token: str | None, where: Path) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"{where}: special token {token!r} is not in tokenizer.json")
        return token_id

    @staticmethod
    def _generation_eos(model_dir: Path) -> list[int]:
        path = model_dir / "generation_config.json"
        if not path.is_file():
            return []
        eos = _read_json(path).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            return list(eos)
        return []

    @staticmethod
    def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
        # Newer checkpoints keep the template in its own file.
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    # ---- encoding -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of `text` alone: special-token strings in it are recognized, nothing is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a raw completion prompt: bos first when `add_bos_token` is set."""
        ids = self.encode(text)
        return [self.bos_token_id, *ids] if self.add_bos_token else ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        `continue_final_message`: the final message is left open (no end of turn after it), for
        the model to continue, as transformers does it: its string content is rendered with a
        tag appended, and the text is cut at the tag (trailing spaces the template trimmed stay
        trimmed). It cannot be combined with `add_generation_prompt`.

        Raises ConfigError when the model has no template, and ValueError (the template's
        `raise_exception`, or a rendering error) when the messages do not fit it; with
        `continue_final_message`, a ValueError starting "continue_final_message:" when the final
        message has no content or the template does not render it unchanged.
        """
        if self.chat_template is None:
            raise ConfigError("the model's tokenizer_config.json has no chat_template")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        final, marker = "", "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' tag
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message: cannot be combined with add_generation_prompt"
                )
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final:
                raise ValueError("continue_final_message: the final message has no content")
            messages = [*messages[:-1], {**messages[-1], "content": final + marker}]
        try:
            rendered = self._compiled_template.render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors: undefined names, type errors in the template
            raise ValueError(f"cannot render the chat template: {exc}") from None
        if not continue_final_message:
            return rendered
        tag = marker.strip()
        if final.strip() not in rendered or tag not in rendered:
            raise ValueError(
                "continue_final_message: the final message does not appear in the chat as the "
                "chat template renders it (the template changes it)"
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(marker)] == marker:
            return rendered[:at]  # the template keeps the content as it is
        return rendered[:at].rstrip()  # it trimmed the content's end: so is the cut text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt=True) -> list[int]:
        """Ids of the rendered chat; no bos is added, the template writes its own."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    # ---- decoding -------------------------------------------------------------------------------
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` as one piece of the vocabulary (added tokens too), or None."""
        return self._tok.token_to_id(token)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _compile_template(source: str):
    """Compile a chat template as transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}") from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces, never splitting a character.

    The concatenation of everything `push` and `flush` return equals `tokenizer.decode(ids)`.
    Each push decodes only a short window of ids (vLLM's prefix/read offsets): the window
    starts at the token before the last emitted one, so merges that depend on the previous
    token (a leading space) decode as in the full text, and the cost per token is O(1).

    A byte-level token may end in the middle of a UTF-8 character; the decoded window then ends
    with U+FFFD and the tail is held back until a later token completes it. Everything before
    the trailing run of U+FFFD is final and is emitted at once.
    """

    # After this many tokens that all left the text ending in U+FFFD, the tail is taken to be
    # invalid bytes, not a character in progress (one needs at most 4 byte tokens), and is
    # emitted as is, so a stream of garbage bytes cannot make the window grow without bound.
    MAX_PENDING = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context for decoding, already emitted
        self._read_offset = 0  # ids before this are emitted in full
        self._emitted = 0  # chars of decode(ids[prefix_offset:]) already returned

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if text.endswith(REPLACEMENT_CHAR) and pending < self.MAX_PENDING:
            # Emit what precedes the unfinished character; keep the window where it is.
            stable = text.rstrip(REPLACEMENT_CHAR)
            if len(stable) <= self._emitted:
                return ""
            out, self._emitted = stable[self._emitted :], len(stable)
            return out
        out = text[self._emitted :]
        # Everything is emitted: slide the window to start at the last token read before.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._emitted = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        return out

    def flush(self) -> str:
        """Return whatever is still held back (an unfinished character decodes as U+FFFD)."""
        text = self._decode(self._ids[self._prefix_offset :])
        out = text[self._emitted :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted = 0
        return out

    @property
    def token_ids(self) -> list[int]:
        return self._ids
