"""The names of the weight quantization schemes (`model.quant` implements them), apart so that
the configs and the router can check a name without importing the kernels."""

from __future__ import annotations

from control.errors import ConfigError

QUANT_SCHEMES = ("none", "int8", "fp8", "int4")
# Where a node's weights live (model.pack_cache.weights_backing): the heap, or a mapped pack on
# a file or shmem, on 4 KiB or 2 MiB pages. Here so the router can check a name without torch.
WEIGHT_BACKINGS = ("heap", "file", "file_hugepages", "shmem", "shmem_hugepages")


def parse_quant(value: object, where: str = "quant") -> str:
    """The scheme's name ("none" for None); a ConfigError naming `where` for anything else."""
    if value is None:
        return "none"
    if not isinstance(value, str) or value not in QUANT_SCHEMES:
        raise ConfigError(f"{where} must be one of {', '.join(QUANT_SCHEMES)}, got {value!r}")
    return value


# The LM head's own scheme, apart from the node's `quant` (a node's `quant_lm_head`): "none"
# keeps it in the model dtype, "int8" runs it W8A8 (`ops.linear_int8`) whatever `quant` is. At
# small-batch decode it is one of the largest matrices read per token (vocab x hidden).
LM_HEAD_SCHEMES = ("none", "int8")


def lm_head_scheme(quant_lm_head: bool) -> str:
    """The head's scheme (one of LM_HEAD_SCHEMES) for a node's `quant_lm_head`."""
    return "int8" if quant_lm_head else "none"


# The head the MTP layer drafts with (a node's `mtp_draft_head`, model.draft_head): the main head
# ("none"), or a copy in int8 or int4. Drafts are only proposals the main head verifies, so this
# moves the acceptance, never the output; int4 reads a quarter of a bf16 head's bytes a draft.
DRAFT_HEAD_SCHEMES = ("none", "int8", "int4")
DEFAULT_DRAFT_HEAD = "int4"


def parse_draft_head(value: object, where: str = "mtp_draft_head") -> str:
    """The draft head's scheme; a ConfigError naming `where` for anything but one of
    DRAFT_HEAD_SCHEMES."""
    if not isinstance(value, str) or value not in DRAFT_HEAD_SCHEMES:
        raise ConfigError(f"{where} must be one of {', '.join(DRAFT_HEAD_SCHEMES)}, got {value!r}")
    return value


# The matrices a scheme other than "none" quantizes (model/quant.py), in two classes of their
# own scheme each: the MLA projections but kv_b_proj (a node's `quant_attention`, see
# `attention_scheme`) and every MLP and expert projection (the node's `quant`). The rest
# (embedding, LM head, kv_b, norms, router gate) stays in the model dtype; the LM head goes int8
# with `quant_lm_head` alone.
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
FP8_BLOCK = 128
INT4_GROUP_SIZE = 64  # the inputs sharing an int4 scale (native/reference_int4.py, model/quant.py)


def attention_scheme(quant: str | None, quant_attention: str | None = None) -> str:
    """The attention projections' scheme on a node of `quant`: `quant_attention` when set (None
    or "", a TOML node's default, is unset), else `quant` itself, but "int8" under "int4" (the
    attention's error feeds the KV cache and every later token, so 4 bits there is opt in)."""
    quant = parse_quant(quant)
    if quant_attention is None or quant_attention == "":
        return "int8" if quant == "int4" else quant
    return parse_quant(quant_attention, "quant_attention")


def _is_layer_weight(name: str, projections: tuple[str, ...]) -> bool:
    return name.startswith("model.layers.") and name.endswith(
        tuple(f".{p}.weight" for p in projections)
    )


def is_quantized(name: str) -> bool:
    """Whether some scheme other than "none" may hold checkpoint tensor `name` (an attention,
    MLP or expert projection); `tensor_scheme` says which one a node does."""
    return _is_layer_weight(name, _ATTENTION + _MLP)


def tensor_scheme(name: str, quant: str | None, quant_attention: str | None = None) -> str:
    """The scheme checkpoint tensor `name` is held in on a node of `quant` and
    `quant_attention`: the attention scheme (`attention_scheme`) for an attention projection,
    `quant` for an MLP or expert projection, "none" (the model dtype) for the rest. The LM head
    has its own (`lm_head_scheme`)."""
    if _is_layer_weight(name, _ATTENTION):
        return attention_scheme(quant, quant_attention)
    if _is_layer_weight(name, _MLP):
        return parse_quant(quant)
    return "none"


def quantized_bytes(
    quant: str, shape: tuple[int, ...], name: str = "", quant_attention: str | None = None
) -> int:
    """Bytes a quantized matrix [N, K] is held in: in scheme `quant`, or with `name` (a
    checkpoint tensor) in the scheme a node of `quant` and `quant_attention` holds it in
    (`tensor_scheme`; ValueError if that is "none"). int8: 1 per weight, plus per row an fp32
    scale and an int32 compensation; int4: a half per weight plus an fp32 scale per group of
    INT4_GROUP_SIZE inputs of a row; fp8: 1 per weight plus an fp32 scale per 128x128 block."""
    scheme = tensor_scheme(name, quant, quant_attention) if name else quant
    n, k = shape
    if scheme == "int4":
        return n * k // 2 + 4 * n * -(-k // INT4_GROUP_SIZE)
    if scheme == "int8":
        return n * k + 8 * n
    if scheme == "fp8":
        blocks = -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
        return n * k + 4 * blocks
    raise ValueError(f"{name or 'the matrix'} is not quantized under quant = {quant!r}")
