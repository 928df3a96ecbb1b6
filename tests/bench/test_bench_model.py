"""make-bench-model: DeepSeek-V2-Lite layer shapes (checked against the issue's numbers and
against transformers' own DeepseekV3 model), a one-layer checkpoint that `duet generate` loads
and runs, and `--fp8`: the same model's FP8 block weights (checked against a plain-torch
dequantization of the bf16 model of the same seed, and loaded for quant "none" and "fp8")."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from control.model_config import ModelConfig
from control.quant_schemes import is_quantized
from control.tokenizer import Tokenizer
from model.batch import ForwardBatch
from model.checkpoint_reader import INDEX_FILE
from model.deepseek import DeepseekModel
from model.weight_names import checkpoint_shapes
from native import ops
from tinymodel import bench_model
from tinymodel.bench_model import (
    BENCH_VOCAB,
    VERSION_FILE,
    _plan_shards,
    _stored_bytes,
    bench_config,
    make_bench_model,
)


def test_shapes_are_v2_lite_and_match_transformers():
    raw = bench_config(4, BENCH_VOCAB, 0, 1)
    shapes = checkpoint_shapes(ModelConfig.from_dict(raw))
    # The numbers: hidden 2048, 16 heads, q_lora 1536, kv_lora 512, nope 128, rope 64,
    # v 128, 64 experts of 1408, 2 shared, dense intermediate 10944, vocab 32000.
    attn = "model.layers.1.self_attn"
    assert shapes[f"{attn}.q_a_proj.weight"] == (1536, 2048)
    assert shapes[f"{attn}.q_b_proj.weight"] == (16 * (128 + 64), 1536)
    assert shapes[f"{attn}.kv_a_proj_with_mqa.weight"] == (512 + 64, 2048)
    assert shapes[f"{attn}.kv_b_proj.weight"] == (16 * (128 + 128), 512)
    assert shapes[f"{attn}.o_proj.weight"] == (2048, 16 * 128)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)
    assert shapes["model.layers.1.mlp.experts.63.up_proj.weight"] == (1408, 2048)
    assert shapes["model.layers.1.mlp.shared_experts.down_proj.weight"] == (2048, 2 * 1408)
    assert shapes["model.layers.1.mlp.gate.weight"] == (64, 2048)
    assert shapes["lm_head.weight"] == (32000, 2048)
    assert raw["num_experts_per_tok"] == 6
    ours = sum(math.prod(s) for s in shapes.values())
    assert 1.9e9 < ours < 2.1e9  # "about 2 B parameters"

    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg)
    hf_params = sum(p.numel() for p in hf.parameters())
    # transformers keeps e_score_correction_bias as a buffer, not a parameter.
    assert ours == hf_params + 3 * 64


def test_shard_plan_is_bounded():
    shapes = {"a": (10, 10), "b": (10, 10), "c": (100, 10), "d": (5,)}
    plan = _plan_shards(shapes, torch.bfloat16, max_shard_bytes=450)
    assert plan == [["a", "b"], ["c"], ["d"]]  # c (2000 B) alone: larger than the limit


@pytest.fixture
def model_dir(tmp_path):
    out = tmp_path / "bench-model"
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 0.4 GB: do not leave it in pytest's tmp folders


def test_one_layer_model_loads_with_generate(model_dir):
    make_bench_model(model_dir, layers=1, seed=0, max_shard_bytes=150 << 20, progress=False)
    cfg = ModelConfig.from_model_dir(model_dir)
    assert cfg.num_hidden_layers == 1 and cfg.vocab_size == BENCH_VOCAB
    expected = checkpoint_shapes(cfg)
    index = json.loads((model_dir / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(expected)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3  # written in bounded pieces
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                assert tuple(f.get_slice(name).get_shape()) == expected[name]
                dtype = f.get_slice(name).get_dtype()
                assert dtype == ("F32" if name.endswith("mlp.gate.weight") else "BF16")

    cmd = [sys.executable, "-m", "deploy.cli", "generate", "--model", str(model_dir),
           "--prompt", "hi", "--max-new-tokens", "2", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = json.loads(proc.stdout)["token_ids"]
    assert len(ids) == 2
    # Greedy output is whole-character tokens of the tokenizer, so each streams as text.
    tok = Tokenizer(model_dir)
    for i in ids:
        assert i < tok.vocab_size and tok.decode([i]) and "\ufffd" not in tok.decode([i])


def test_cli_rejects_bad_layers(tmp_path, capsys):
    from deploy import cli

    with pytest.raises(SystemExit):
        cli.main(["make-bench-model", str(tmp_path / "x"), "--layers", "0"])
    assert "--layers must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---- --fp8 --------------------------------------------------------------------------------------
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
SHARD = 100 << 20


def _small_experts(*args):
    """bench_config with 8 routed experts (top-2 of 4 groups): a 2-layer model (one MoE layer,
    V2-Lite's attention and expert shapes) of 0.33 B parameters, small enough to write twice."""
    raw = bench_config(*args)
    raw.update(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
    return raw


@pytest.fixture(scope="module")
def bf16_and_fp8(tmp_path_factory):
    """The same 2-layer model (seed 3) written in bf16 and with --fp8."""
    root = tmp_path_factory.mktemp("bench-fp8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_model, "bench_config", _small_experts)
        kw = {"layers": 2, "seed": 3, "max_shard_bytes": SHARD, "progress": False}
        bf16 = make_bench_model(root / "bf16", **kw)
        fp8 = make_bench_model(root / "fp8", fp8=True, **kw)
    yield bf16, fp8
    shutil.rmtree(root, ignore_errors=True)


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / INDEX_FILE).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    stored = sum(t.numel() * t.element_size() for t in out.values())
    assert index["metadata"]["total_size"] == stored
    return out


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The oracle: every weight times its 128x128 block's scale."""
    n, k = w.shape
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return w.float() * full


def test_fp8_checkpoint_is_the_bf16_model_quantized(bf16_and_fp8):
    bf16_dir, fp8_dir = bf16_and_fp8
    assert "quantization_config" not in json.loads((bf16_dir / "config.json").read_text())
    raw = json.loads((fp8_dir / "config.json").read_text())
    assert raw["quantization_config"] == FP8_CONFIG and raw["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_model_dir(fp8_dir).quant.weight_block_size == (128, 128)
    info = json.loads((fp8_dir / VERSION_FILE).read_text())
    assert info["fp8"] is True and info["layers"] == 2 and info["seed"] == 3
    assert json.loads((bf16_dir / VERSION_FILE).read_text())["fp8"] is False

    want, got = _tensors(bf16_dir), _tensors(fp8_dir)
    quantized = sorted(name for name in want if is_quantized(name))
    assert set(got) == set(want) | {f"{name}_scale_inv" for name in quantized}
    kinds = {name.split(".")[-2] for name in quantized}
    assert kinds == {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert any(".experts.7." in name for name in quantized)
    assert any(".shared_experts." in name for name in quantized)
    for name, w in want.items():
        if not is_quantized(name):  # embedding, head, norms, kv_b_proj, router: as in bf16
            assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
            continue
        q, scale = got[name], got[f"{name}_scale_inv"]
        n, k = w.shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, name
        assert scale.dtype == torch.float32
        assert scale.shape == (math.ceil(n / 128), math.ceil(k / 128)), name
        # e4m3 rounds to 3 mantissa bits (half a step: 1/16 of the value), or to its smallest
        # subnormal step (2^-9 of the block's scale) near zero; the largest in a block is exact.
        deq, ref = _dequantize(q, scale), w.float()
        full_scale = _dequantize(torch.ones_like(q, dtype=torch.float32), scale)
        err = (deq - ref).abs()
        bound = (ref.abs() / 16 + full_scale * 2**-10) * (1 + 1e-5)  # (+ fp32 rounding)
        assert (err <= bound).all(), name
        assert 0 < (err.norm() / ref.norm()).item() < 0.05, name
        assert torch.allclose(scale * 448, _block_amax(ref), rtol=1e-6), name


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    padded = torch.zeros(math.ceil(n / 128) * 128, math.ceil(k / 128) * 128)
    padded[:n, :k] = w.abs()
    return padded.view(padded.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3))


def _prefill_logits(model: DeepseekModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of one prefill on a small private pool."""
    pool = model.new_kv_pool(num_pages=4, page_size=16)
    table = pool.new_table()
    pool.reserve(table, len(prompt))
    batch = ForwardBatch.build(pool, [table], [prompt], [0], is_decode=False)
    return model.forward(batch, pool).float()


PROMPT = list(range(40, 60))


def _load(model_dir, quant: str) -> DeepseekModel:
    return DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False, quant=quant)


@pytest.fixture(scope="module")
def bf16_logits(bf16_and_fp8):
    return _prefill_logits(_load(bf16_and_fp8[0], "none"), PROMPT)


@pytest.fixture(scope="module")
def fp8_as_bf16_logits(bf16_and_fp8):
    """The fp8 checkpoint loaded with quant "none" (dequantized to bf16)."""
    model = _load(bf16_and_fp8[1], "none")
    assert model.quant == "none" and model.cfg.num_hidden_layers == 2
    return _prefill_logits(model, PROMPT)


def test_fp8_checkpoint_loads_with_quant_none(bf16_logits, fp8_as_bf16_logits):
    """Dequantized, it runs like the bf16 model of its seed. Measured: median relative error
    0.075, every argmax the same (a random model amplifies the fp8 rounding); a wrong scale or
    layout gives errors near 1."""
    got, want = fp8_as_bf16_logits, bf16_logits
    rel_err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
    assert 0 < rel_err < 0.15, rel_err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")
def test_fp8_checkpoint_loads_with_quant_fp8(bf16_and_fp8, fp8_as_bf16_logits):
    """Kept as stored: it runs like its dequantized bf16 copy (bf16 rounding apart)."""
    model = _load(bf16_and_fp8[1], "fp8")
    assert model.quant == "fp8"
    got = _prefill_logits(model, PROMPT)
    want = fp8_as_bf16_logits
    rel_err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel_err < 0.03, rel_err


def test_fp8_halves_the_disk_and_shards_count_stored_bytes():
    for layers, ratio in ((4, 0.54), (27, 0.51)):
        shapes = checkpoint_shapes(ModelConfig.from_dict(bench_config(layers, BENCH_VOCAB, 0, 1)))
        bf16 = sum(_stored_bytes(n, s, torch.bfloat16) for n, s in shapes.items())
        fp8 = sum(_stored_bytes(n, s, torch.bfloat16, fp8=True) for n, s in shapes.items())
        assert fp8 / bf16 < ratio, (layers, fp8 / bf16)
        plans = {f: _plan_shards(shapes, torch.bfloat16, 512 << 20, fp8=f) for f in (False, True)}
        for f, plan in plans.items():
            assert [n for names in plan for n in names] == list(shapes)
            for names in plan:
                size = sum(_stored_bytes(n, shapes[n], torch.bfloat16, f) for n in names)
                assert size <= 512 << 20 or len(names) == 1
        assert len(plans[True]) < 0.6 * len(plans[False])
    name, shape = "model.layers.3.mlp.experts.0.down_proj.weight", (2048, 1408)
    assert _stored_bytes(name, shape, torch.bfloat16, fp8=True) == 2048 * 1408 + 4 * 16 * 11


def test_cli_passes_fp8(tmp_path, monkeypatch):
    from deploy import cli

    calls = []
    monkeypatch.setattr(bench_model, "make_bench_model", lambda *a, **kw: calls.append((a, kw)))
    cli.main(["make-bench-model", str(tmp_path / "x"), "--layers", "27", "--fp8"])
    cli.main(["make-bench-model", str(tmp_path / "y")])
    assert calls[0][0][1] == 27 and calls[0][1]["fp8"] is True
    assert calls[1][0][1] == 4 and calls[1][1]["fp8"] is False
