"""Checkpoint loading: single vs sharded, dtypes, FP8 dequantization, EP subsets, and every
error path. The oracle is the file contents read back with `safetensors.torch.load_file`."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from control.errors import WeightLoadError
from control.model_config import ModelConfig
from model.checkpoint_reader import INDEX_FILE, SINGLE_FILE
from model.fp8_blocks import dequantize_fp8_blockwise, quantize_fp8_blockwise
from model.weight_names import checkpoint_shapes
from model.weights import load_checkpoint, save_checkpoint
from tinymodel.make import make_tiny_model

ROUTER_SUFFIXES = (".mlp.gate.weight", ".e_score_correction_bias")


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("single"), seed=1)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sharded"), seed=1, max_shard_bytes=200_000)


def _expected(model_dir, keep_expert=None):
    return checkpoint_shapes(ModelConfig.from_model_dir(model_dir), keep_expert)


def _file_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Everything in a checkpoint, read independently of the loader."""
    index = model_dir / INDEX_FILE
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else None
    out = {}
    for name in files or [SINGLE_FILE]:
        out.update(load_file(str(model_dir / name)))
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- round trips ----------------------------------------------------------------------------------
def test_single_and_sharded_load_identical(single_dir, sharded_dir):
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded_dir / SINGLE_FILE).exists()

    expected = _expected(single_dir)
    one = load_checkpoint(single_dir, expected, torch.float32, progress=False)
    many = load_checkpoint(sharded_dir, expected, torch.float32, progress=False)
    raw = _file_tensors(single_dir)
    assert list(one) == list(expected) == list(many)
    for name, shape in expected.items():
        assert one[name].shape == shape
        assert torch.equal(one[name], many[name]), name
        assert torch.equal(one[name], raw[name]), name


def test_dtype_cast_keeps_router_in_fp32(single_dir):
    expected = _expected(single_dir)
    got = load_checkpoint(single_dir, expected, torch.bfloat16, progress=False)
    raw = _file_tensors(single_dir)
    routers = [n for n in got if n.endswith(ROUTER_SUFFIXES)]
    assert routers  # the tiny model has MoE layers with the noaux_tc bias
    for name, t in got.items():
        want = torch.float32 if name.endswith(ROUTER_SUFFIXES) else torch.bfloat16
        assert t.dtype == want, name
        assert t.is_contiguous()
        assert torch.equal(t, raw[name].to(want)), name


def test_bf16_and_fp16_files_load(tmp_path):
    tensors = {
        "a.weight": torch.randn(5, 7).to(torch.bfloat16),
        "b.weight": torch.randn(3).to(torch.float16),
    }
    save_checkpoint(tmp_path, tensors)
    got = load_checkpoint(tmp_path, {"a.weight": (5, 7), "b.weight": (3,)}, torch.float32, False)
    for name, t in tensors.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], t.float())


def test_only_expected_tensors_are_read(tmp_path, single_dir):
    """MTP-layer tensors and other unknown names are skipped; an EP rank reads its experts only."""
    cfg = ModelConfig.from_model_dir(single_dir)
    tensors = _file_tensors(single_dir)
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(4, 4)
    tensors[f"{mtp}.self_attn.kv_a_proj_with_mqa.weight"] = torch.randn(2, 2)
    tensors["some.unrelated.tensor"] = torch.zeros(1, dtype=torch.int64)  # unsupported dtype
    save_checkpoint(tmp_path, tensors)

    def keep(e):
        return e < 4

    expected = _expected(single_dir, keep_expert=keep)
    got = load_checkpoint(tmp_path, expected, torch.float32, progress=False)
    assert set(got) == set(expected)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in got
    assert "model.layers.1.mlp.experts.4.up_proj.weight" not in got
    assert not any(n.startswith(mtp) for n in got)


# ---- FP8 ----------------------------------------------------------------------------------------
def _dequant_by_hand(w_fp8, scale_inv, block):
    n, k = w_fp8.shape
    s = scale_inv.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w_fp8.float() * s


@pytest.mark.parametrize("shape", [(1, 1), (19, 33), (128, 128), (200, 130), (257, 64)])
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_quantize_partial_blocks(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different scale
    q, scale_inv = quantize_fp8_blockwise(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    deq = dequantize_fp8_blockwise(q, scale_inv, block)
    assert torch.equal(deq, _dequant_by_hand(q, scale_inv, block))
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding half of it); subnormal step 2^-9.
    step = _dequant_by_hand(torch.ones_like(q), scale_inv, block)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + step * 2**-10 + 1e-30).all()


def test_fp8_checkpoint_round_trip(tmp_path):
    plain = make_tiny_model(tmp_path / "plain", seed=2)
    fp8 = make_tiny_model(tmp_path / "fp8", seed=2, fp8=True, max_shard_bytes=150_000)
    cfg = ModelConfig.from_model_dir(fp8)
    assert cfg.quant is not None and cfg.quant.weight_block_size == (128, 128)
    expected = checkpoint_shapes(cfg)
    want = load_checkpoint(plain, expected, torch.float32, progress=False)
    got = load_checkpoint(fp8, expected, torch.float32, False, fp8_block=(128, 128))
    raw = _file_tensors(fp8)
    num_fp8 = 0
    for name in expected:
        if raw[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(got[name], want[name]), name
            continue
        num_fp8 += 1
        by_hand = _dequant_by_hand(raw[name], raw[name + "_scale_inv"], (128, 128))
        assert torch.equal(got[name], by_hand), name
        amax = want[name].abs().max()
        tol = want[name].abs() * 2**-4 + amax / 448 * 2**-9
        assert ((got[name] - want[name]).abs() <= tol).all(), name
    assert num_fp8 > 20
    # And cast after dequantization for a bf16 model.
    got16 = load_checkpoint(fp8, expected, torch.bfloat16, False, fp8_block=(128, 128))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(got16[name], got[name].to(torch.bfloat16))


def test_fp8_without_block_size_is_refused(tmp_path):
    model = make_tiny_model(tmp_path, seed=2, fp8=True)
    with pytest.raises(WeightLoadError, match=r"q_a_proj\.weight.*weight_block_size"):
        load_checkpoint(model, _expected(model), torch.float32, progress=False)


def test_fp8_scale_errors(tmp_path):
    w = torch.randn(200, 130)
    q, s = quantize_fp8_blockwise(w)
    save_checkpoint(tmp_path / "noscale", {"x.weight": q})
    with pytest.raises(WeightLoadError, match=r"'x\.weight_scale_inv' is missing from .*model"):
        load_checkpoint(
            tmp_path / "noscale", {"x.weight": (200, 130)}, torch.float32, False, (128, 128)
        )
    save_checkpoint(tmp_path / "badscale", {"x.weight": q, "x.weight_scale_inv": s[:1]})
    with pytest.raises(
        WeightLoadError, match=r"'x\.weight_scale_inv' in .*expected shape \[2, 2\]"
    ):
        load_checkpoint(
            tmp_path / "badscale", {"x.weight": (200, 130)}, torch.float32, False, (128, 128)
        )


# ---- errors -------------------------------------------------------------------------------------
def _rewrite(path, drop=(), change=None):
    tensors = load_file(str(path))
    for name in drop:
        del tensors[name]
    tensors.update(change or {})
    save_file(tensors, str(path), metadata={"format": "pt"})


def _load_error(model_dir, dtype=torch.float32) -> str:
    with pytest.raises(WeightLoadError) as info:
        load_checkpoint(model_dir, _expected(model_dir), dtype, progress=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_tensor_single_file(tmp_path, single_dir):
    model = _copy(single_dir, tmp_path / "m")
    _rewrite(model / SINGLE_FILE, drop=["model.layers.2.self_attn.o_proj.weight"])
    message = _load_error(model)
    assert "model.layers.2.self_attn.o_proj.weight" in message
    assert str(model / SINGLE_FILE) in message and "missing" in message


def test_missing_tensor_in_index(tmp_path, sharded_dir):
    model = _copy(sharded_dir, tmp_path / "m")
    index = json.loads((model / INDEX_FILE).read_text())
    del index["weight_map"]["model.norm.weight"]
    (model / INDEX_FILE).write_text(json.dumps(index))
    message = _load_error(model)
    assert "'model.norm.weight'" in message and str(model / INDEX_FILE) in message


def test_index_names_tensor_its_shard_lacks(tmp_path, sharded_dir):
    model = _copy(sharded_dir, tmp_path / "m")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    shard = json.loads((model / INDEX_FILE).read_text())["weight_map"][name]
    _rewrite(model / shard, drop=[name])
    message = _load_error(model)
    assert name in message and str(model / shard) in message


def test_index_points_to_missing_shard(tmp_path, sharded_dir):
    model = _copy(sharded_dir, tmp_path / "m")
    index = json.loads((model / INDEX_FILE).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    (model / shard).unlink()
    message = _load_error(model)
    assert str(model / shard) in message and "does not exist" in message
    assert "tensor '" in message


def test_misshaped_tensor(tmp_path, single_dir):
    model = _copy(single_dir, tmp_path / "m")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite(model / SINGLE_FILE, change={name: torch.zeros(3, 5)})
    message = _load_error(model)
    assert name in message and str(model / SINGLE_FILE) in message
    assert "expected shape [128, 32], got [3, 5]" in message


def test_unsupported_dtype(tmp_path, single_dir):
    model = _copy(single_dir, tmp_path / "m")
    _rewrite(model / SINGLE_FILE, change={"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    message = _load_error(model)
    assert "'model.norm.weight'" in message and str(model / SINGLE_FILE) in message
    assert "unsupported dtype I32" in message


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file(tmp_path, single_dir, sharded_dir, damage):
    for src in (single_dir, sharded_dir):
        model = _copy(src, tmp_path / f"{src.name}-{damage}")
        files = sorted(model.glob("*.safetensors"))
        victim = files[len(files) // 2]
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 100)
        message = _load_error(model)
        assert str(victim) in message and "corrupt" in message
        assert "tensor '" in message


def test_corrupt_index_and_empty_dir(tmp_path, sharded_dir):
    model = _copy(sharded_dir, tmp_path / "m")
    (model / INDEX_FILE).write_text("{ not json")
    message = _load_error(model)
    assert str(model / INDEX_FILE) in message
    (model / INDEX_FILE).write_text(json.dumps({"weight_map": ["not", "a", "map"]}))
    assert str(model / INDEX_FILE) in _load_error(model)
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        load_checkpoint(tmp_path, {"x": (1,)}, torch.float32, progress=False)


# ---- writing ------------------------------------------------------------------------------------
def test_save_shards_respect_limit(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(10)}  # 400 bytes each
    tensors["big"] = torch.zeros(1000)  # larger than the limit: a shard of its own
    files = save_checkpoint(tmp_path, tensors, max_shard_bytes=1000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 10 * 400 + 4000
    assert len(files) == 6 and set(index["weight_map"]) == set(tensors)
    for f in files:
        shard = load_file(str(f))
        assert len(shard) == 1 or sum(t.numel() * 4 for t in shard.values()) <= 1000
    got = load_checkpoint(
        tmp_path, {n: tuple(t.shape) for n, t in tensors.items()}, torch.float32, False
    )
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
