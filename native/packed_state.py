"""The packed weights as plain state: what a packed weight store (model/weight_pack.py) writes
and maps back.

`to_state(obj, put)` turns what a prepack op returned (a packed class of this package, a plain
tensor, the reference twins' tuples) into a JSON-able entry, handing each tensor to `put`, which
returns its reference; `from_state(entry, get)` rebuilds the object around the tensors `get`
returns for those references (views into a mapped file: nothing is copied). Only the classes
listed here are ever rebuilt, by name, from their slots: a manifest names data, never code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from native import reference
from native._fp8_ops import PackedLinearFp8
from native._gemm_ops import PackedLinear
from native._int4_ops import PackedLinearInt4
from native._moe_fp8_ops import PackedExpertsFp8
from native._moe_int4_ops import PackedExpertsInt4
from native._moe_int8_ops import PackedExpertsInt8
from native._quant_ops import PackedLinearInt8
from native.reference_int4 import Int4Weight

Entry = dict[str, Any]
_PACKED_CLASSES = {
    cls.__name__: cls
    for cls in (
        PackedLinear,
        PackedLinearInt8,
        PackedLinearInt4,
        PackedLinearFp8,
        PackedExpertsInt8,
        PackedExpertsInt4,
        PackedExpertsFp8,
    )
}
# Slots recomputed from the others when an object is rebuilt (raw pointers are per process).
_DERIVED = {"kernel_args"}


def _packed_class(obj: object, op: str) -> type:
    """The class of `obj`, one of the packed classes listed here (TypeError naming `op` else)."""
    cls = type(obj)
    if _PACKED_CLASSES.get(cls.__name__) is not cls:
        raise TypeError(f"{op}: not a packed weight: {cls.__qualname__}")
    return cls


def to_state(obj: object, put: Callable[[torch.Tensor], Any]) -> Entry:
    """The entry of `obj`; `put(tensor)` stores a tensor and returns its JSON-able reference."""
    if isinstance(obj, torch.Tensor):
        return {"kind": "tensor", "ref": put(obj)}
    if isinstance(obj, reference.Int8Weight):
        return {"kind": "Int8Weight", "items": [to_state(t, put) for t in obj]}
    if isinstance(obj, Int4Weight):
        items = [to_state(t, put) for t in (obj.qweight, obj.scale)]
        return {"kind": "Int4Weight", "items": items, "meta": {"group_size": obj.group_size}}
    if isinstance(obj, tuple):
        return {"kind": "tuple", "items": [to_state(item, put) for item in obj]}
    cls = _packed_class(obj, "to_state")
    tensors, meta = {}, {}
    for slot in cls.__slots__:
        if slot in _DERIVED:
            continue
        value = getattr(obj, slot)
        if isinstance(value, torch.Tensor):
            tensors[slot] = put(value)
        elif isinstance(value, (int, tuple)):  # sizes; torch.Size is a tuple of ints
            meta[slot] = [int(v) for v in value] if isinstance(value, tuple) else int(value)
        else:
            raise TypeError(f"to_state: {cls.__name__}.{slot} is a {type(value).__name__}")
    return {"kind": cls.__name__, "tensors": tensors, "meta": meta}


def from_state(entry: Entry, get: Callable[[Any], torch.Tensor]) -> object:
    """The object of `entry` (`to_state`'s), its tensors `get(ref)`."""
    kind = entry["kind"]
    if kind == "tensor":
        return get(entry["ref"])
    if kind == "Int4Weight":
        qweight, scale = (from_state(item, get) for item in entry["items"])
        return Int4Weight(qweight, scale, int(entry["meta"]["group_size"]))
    if kind in ("tuple", "Int8Weight"):
        items = tuple(from_state(item, get) for item in entry["items"])
        return reference.Int8Weight(*items) if kind == "Int8Weight" else items
    if kind not in _PACKED_CLASSES:
        raise ValueError(f"from_state: unknown kind {kind!r}")
    cls = _PACKED_CLASSES[kind]
    obj = cls.__new__(cls)
    for slot, ref in entry["tensors"].items():
        setattr(obj, slot, get(ref))
    for slot, value in entry["meta"].items():
        setattr(obj, slot, torch.Size(value) if slot == "shape" else value)
    if isinstance(obj, (PackedLinearInt8, PackedLinearInt4)):
        obj.bind_kernel_args()
    return obj


def select_experts(obj: object, experts: range) -> object:
    """The routed experts `experts` of a layer's packed experts of every expert (any form a
    prepack_experts op returns: every tensor in it is expert-major), as views: what packing
    only those experts gives, so an expert-parallel rank maps its shard out of the whole
    model's pack and shares its pages with every other process of the host."""
    cut = slice(experts.start, experts.stop)
    if isinstance(obj, torch.Tensor):
        return obj[cut]
    if isinstance(obj, reference.Int8Weight):
        return reference.Int8Weight(*(select_experts(item, experts) for item in obj))
    if isinstance(obj, Int4Weight):
        return obj._replace(qweight=obj.qweight[cut], scale=obj.scale[cut])
    if isinstance(obj, tuple):
        return tuple(select_experts(item, experts) for item in obj)
    cls = _packed_class(obj, "select_experts")
    out = cls.__new__(cls)
    for slot in cls.__slots__:
        if slot in _DERIVED:
            continue
        value = getattr(obj, slot)
        if isinstance(value, torch.Tensor):
            value = value[cut]
        elif slot == "shape":
            value = torch.Size((len(experts), *value[1:]))
        setattr(out, slot, value)
    return out
