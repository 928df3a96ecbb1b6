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


# The matrices a scheme other than "none" quantizes (model/quant.py): every MLA projection but
# kv_b_proj, and every MLP and expert projection. The rest (embedding, LM head, kv_b, norms,
# router gate) stays in the model dtype; the LM head goes int8 with `quant_lm_head` alone.
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_QUANTIZED = _ATTENTION + _MLP
FP8_BLOCK = 128
INT4_GROUP_SIZE = 64  # the inputs sharing an int4 scale (native/reference_int4.py, model/quant.py)


def is_quantized(name: str) -> bool:
    """Whether a scheme other than "none" quantizes the checkpoint tensor `name`."""
    return name.startswith("model.layers.") and name.endswith(
        tuple(f".{p}.weight" for p in _QUANTIZED)
    )


def is_int4(name: str) -> bool:
    """Whether the "int4" scheme holds checkpoint tensor `name` in 4 bits: the MLP and expert
    projections (dense, shared, routed); its attention projections run W8A8 int8."""
    return name.startswith("model.layers.") and name.endswith(tuple(f".{p}.weight" for p in _MLP))


def quantized_bytes(quant: str, shape: tuple[int, ...], name: str = "") -> int:
    """Bytes a quantized matrix [N, K] (checkpoint tensor `name`) is held in: 1 per weight, plus
    per row an fp32 scale and an int32 compensation (int8, and the "int4" scheme's attention), a
    half per weight plus an fp32 scale per group of INT4_GROUP_SIZE inputs of a row (int4), or an
    fp32 scale per 128x128 block (fp8)."""
    n, k = shape
    if quant == "int4" and is_int4(name):
        return n * k // 2 + 4 * n * -(-k // INT4_GROUP_SIZE)
    if quant in ("int8", "int4"):
        return n * k + 8 * n
    blocks = -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
    return n * k + 4 * blocks
