"""model.safetensors_reader against the safetensors library (the oracle for the format), and
the property the loader relies on: a tensor read owns its memory (no file mapping behind it)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.safetensors_reader import SafetensorsError, SafetensorsFile


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "bf16": torch.randn(7, 33, generator=g).to(torch.bfloat16),
        "f32": torch.randn(5, generator=g),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "fp8": torch.randn(16, 9, generator=g).to(torch.float8_e4m3fn),
        "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


def test_every_tensor_reads_as_the_library_reads_it(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(sample_tensors(), str(path), metadata={"format": "pt"})
    want = load_file(str(path))
    with SafetensorsFile(path) as f:
        assert sorted(f.keys()) == sorted(want)
        for name, expected in want.items():
            got = f.get_tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert got.reshape(-1).view(torch.uint8).equal(expected.reshape(-1).view(torch.uint8))
        assert f.dtype_of("fp8") == "F8_E4M3" and f.shape_of("f16") == (2, 3, 4)


def test_a_tensor_read_does_not_depend_on_the_file_afterwards(tmp_path):
    """A memory-mapped tensor sees the file change under it (or faults when it shrinks); one
    read into its own memory does not."""
    path = tmp_path / "m.safetensors"
    tensors = {"w": torch.randn(256, 256)}
    save_file(tensors, str(path))
    with SafetensorsFile(path) as f:
        w = f.get_tensor("w")
    size = path.stat().st_size
    with open(path, "r+b") as raw:  # the same file, overwritten in place
        raw.seek(size - 256 * 256 * 4)
        raw.write(b"\0" * (256 * 256 * 4))
    assert torch.equal(w, tensors["w"])
    path.write_bytes(b"")  # and truncated
    assert torch.equal(w, tensors["w"])


def _raw_file(tmp_path, header, data: bytes = b"", header_len: int | None = None):
    body = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    length = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + body + data)
    return path


@pytest.mark.parametrize(
    "header,data,header_len,message",
    [
        ({}, b"", 10**9, "exceeds the file"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"", None, "malformed header entry"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234", None, "outside"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"12345678", None, "bytes"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, "shape"),
        ({"w": {"dtype": 5, "shape": [], "data_offsets": [0, 4]}}, b"1234", None, "dtype"),
    ],
)
def test_malformed_files_are_a_clear_error(tmp_path, header, data, header_len, message):
    path = _raw_file(tmp_path, header, data, header_len)
    with pytest.raises(SafetensorsError, match=message):
        SafetensorsFile(path)


def test_short_and_non_json_headers(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\1\2\3")
    with pytest.raises(SafetensorsError, match="8-byte"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(SafetensorsError, match="not JSON"):
        SafetensorsFile(path)


def test_an_unknown_dtype_is_an_error_when_read(tmp_path):
    path = _raw_file(tmp_path, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"x")
    with SafetensorsFile(path) as f, pytest.raises(SafetensorsError, match="unknown dtype F4"):
        f.get_tensor("w")
