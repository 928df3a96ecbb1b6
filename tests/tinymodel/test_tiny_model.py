"""The built-in tiny model: determinism, config contents, variants, FP8, the cached copy, and
loadability by Hugging Face transformers (the oracle for what a valid checkpoint is)."""

import fcntl
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

import tinymodel.make as tiny
from control.builtin_model import builtin_model_dir
from control.model_config import ModelConfig
from control.tokenizer import Tokenizer
from model.weight_names import checkpoint_shapes
from model.weights import load_checkpoint
from tinymodel.builder import V2_LITE_OVERRIDES
from tinymodel.make import ensure_tiny_model, make_tiny_model

V2_LITE = V2_LITE_OVERRIDES


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_same_seed_same_files(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=5)
    b = make_tiny_model(tmp_path / "b", seed=5)
    c = make_tiny_model(tmp_path / "c", seed=6)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_config_and_weights(tmp_path):
    model = make_tiny_model(tmp_path, seed=0)
    raw = _config(model)
    assert raw["model_type"] == "deepseek_v3"
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert raw["rope_scaling"]["type"] == "yarn" and raw["rope_scaling"]["factor"] == 4
    assert raw["torch_dtype"] == "float32"
    cfg = ModelConfig.from_model_dir(model)
    assert cfg.rope.kind == "yarn" and cfg.q_lora_rank is not None
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0) and cfg.uses_correction_bias

    tok = Tokenizer(model)
    assert tok.vocab_size <= cfg.vocab_size < tok.vocab_size + 64
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tuple(tok.eos_token_ids))

    weights = load_file(str(model / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in weights.items()} == checkpoint_shapes(cfg)
    for name, w in weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, w.to(torch.bfloat16).float()), f"{name} not bf16-exact"
        if name.endswith("norm.weight"):
            assert ((w - 1).abs() <= 0.1 + 2**-7).all() and w.std() > 0.01  # 1 ± 0.1 in bf16
        elif w.dim() == 2 and name != "model.embed_tokens.weight":
            assert 0.01 < w.std() < 1.0, name
    assert weights["lm_head.weight"].std() > 3 * weights["model.layers.0.mlp.up_proj.weight"].std()


def test_overrides_v2_lite_and_dtype(tmp_path):
    model = make_tiny_model(tmp_path, seed=0, overrides=V2_LITE, dtype=torch.bfloat16)
    raw = _config(model)
    assert raw["model_type"] == "deepseek_v2"
    assert "q_lora_rank" in raw and raw["q_lora_rank"] is None  # null, not absent
    assert raw["rope_scaling"] is None
    weights = load_file(str(model / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert not any("e_score_correction_bias" in n for n in weights)
    assert weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert weights["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16


def test_fp8_checkpoint(tmp_path):
    model = make_tiny_model(tmp_path, seed=0, fp8=True)
    q = _config(model)["quantization_config"]
    assert q == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    weights = load_file(str(model / "model.safetensors"))
    not_fp8 = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight")
    for name in not_fp8:
        assert weights[name].dtype == torch.float32
    fp8 = [n for n, t in weights.items() if t.dtype == torch.float8_e4m3fn]
    assert "model.layers.1.self_attn.kv_b_proj.weight" in fp8
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in fp8
    for name in fp8:
        scale = weights[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and scale.shape == (1, 1)  # one partial block


def test_sharded_model(tmp_path):
    model = make_tiny_model(tmp_path, seed=0, max_shard_bytes=300_000)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = ModelConfig.from_model_dir(model)
    assert set(load_checkpoint(model, checkpoint_shapes(cfg), torch.float32, False)) == set(
        checkpoint_shapes(cfg)
    )


# ---- transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [{}, {"first_k_dense_replace": 0}, V2_LITE],
    ids=["v3", "v3_no_dense", "v2_lite"],
)
def test_transformers_loads_and_runs(tmp_path, overrides):
    transformers = pytest.importorskip("transformers")
    model_dir = make_tiny_model(tmp_path, seed=1, overrides=overrides)
    cls = getattr(transformers, _config(model_dir)["architectures"][0])
    model, info = cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    cfg = ModelConfig.from_model_dir(model_dir)
    ours = load_checkpoint(model_dir, checkpoint_shapes(cfg), torch.float32, progress=False)
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.2.mlp.gate.weight"):
        assert torch.equal(state[name], ours[name]), name

    tok = Tokenizer(model_dir)
    ids = torch.tensor([tok.encode_prompt("The cat sat on the mat, café 日本語.")])
    with torch.no_grad():
        logits = model.eval()(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0  # a clear spread between candidate tokens


# ---- the cached copy ----------------------------------------------------------------------------
# The cache machinery runs on a fast builder (random weights) under a fixed key; the trained
# default itself is tested in test_tiny_train.py.
@pytest.fixture
def fast_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    builds = []

    def build(out_dir):
        builds.append(out_dir)
        make_tiny_model(out_dir)

    monkeypatch.setattr(tiny, "_build_default", build)
    monkeypatch.setattr(tiny, "_default_key", lambda: "key-1")
    return builds


LEFT_IN_CACHE = [".tiny-model.lock", "tiny-model"]


def test_ensure_tiny_model_once_and_rebuilds_stale(tmp_path, monkeypatch, fast_cache):
    assert builtin_model_dir() == tmp_path / "tiny-model"
    first = ensure_tiny_model()
    assert first == tmp_path / "tiny-model"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert len(fast_cache) == 1

    monkeypatch.setattr(tiny, "TINY_MODEL_VERSION", tiny.TINY_MODEL_VERSION + 1)
    again = ensure_tiny_model()
    assert json.loads((again / tiny.VERSION_FILE).read_text())["version"] == tiny.TINY_MODEL_VERSION
    assert len(fast_cache) == 2
    monkeypatch.setattr(tiny, "_default_key", lambda: "key-2")  # new corpus, seed or code
    assert json.loads((ensure_tiny_model() / tiny.VERSION_FILE).read_text())["key"] == "key-2"
    assert len(fast_cache) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == LEFT_IN_CACHE  # no leftovers


def test_ensure_tiny_model_race(tmp_path, fast_cache):
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_model())
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 3 and len(set(results)) == 1
    assert len(fast_cache) == 1  # the lock: one builds, the others wait and reuse it
    assert sorted(p.name for p in tmp_path.iterdir()) == LEFT_IN_CACHE
    cfg = ModelConfig.from_model_dir(results[0])
    assert len(load_checkpoint(results[0], checkpoint_shapes(cfg), torch.float32, False)) > 0


def test_ensure_tiny_model_lock_wait_is_bounded(tmp_path, monkeypatch, fast_cache):
    monkeypatch.setattr(tiny, "LOCK_TIMEOUT_S", 0.5)
    with open(tmp_path / ".tiny-model.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is building
        with pytest.raises(tiny.TinyModelLockTimeout, match="waited"):
            ensure_tiny_model()
    assert not fast_cache
    assert ensure_tiny_model() == tmp_path / "tiny-model"  # released: builds


def test_trained_mode_takes_only_a_seed(tmp_path):
    with pytest.raises(ValueError, match="only a seed"):
        make_tiny_model(tmp_path, random=False, fp8=True)
