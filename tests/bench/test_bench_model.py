"""make-bench-model: DeepSeek-V2-Lite layer shapes (checked against the issue's numbers and
against transformers' own DeepseekV3 model), and a one-layer checkpoint that `duet generate`
loads and runs."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from engine.bench_model import BENCH_VOCAB, _plan_shards, bench_config, make_bench_model
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from engine.weight_names import checkpoint_shapes
from engine.weights import INDEX_FILE


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
