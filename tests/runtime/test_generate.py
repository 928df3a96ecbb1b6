"""Offline generation: chunked prefill and page size do not change the result; FP8 checkpoints
match their dequantized twin."""

import pytest
import torch

from control.errors import InvalidRequestError
from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from model.fp8_blocks import dequantize_fp8_blockwise
from model.weights import save_checkpoint
from native import ops
from runtime.generate import OfflineGenerator
from tinymodel.make import make_tiny_model

PROMPT = [3, 44, 18, 250, 9, 71, 130, 5, 66, 301, 12, 40, 77, 8, 2, 90, 11, 19, 23]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def model(model_dir):
    return DeepseekModel.from_pretrained(model_dir, dtype=torch.float32, progress=False)


@pytest.fixture(autouse=True)
def reference_ops():
    was = ops.native_available()
    ops.set_native_enabled(False)
    yield
    ops.set_native_enabled(was)


def _prefill_logits(model, chunk_size, page_size=4):
    gen = OfflineGenerator(model, page_size=page_size, chunk_size=chunk_size)
    table = gen.pool.new_table()
    logits = gen.prefill(table, PROMPT)
    gen.pool.release(table)
    return logits


def test_chunk_size_does_not_change_logits(model):
    whole = _prefill_logits(model, chunk_size=len(PROMPT))
    for chunk in (1, 7):
        torch.testing.assert_close(_prefill_logits(model, chunk), whole, rtol=1e-5, atol=1e-5)


def test_page_size_does_not_change_tokens(model):
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    runs = [
        OfflineGenerator(model, page_size=p, chunk_size=5).generate(PROMPT, params).token_ids
        for p in (1, 3, 16)
    ]
    assert len(runs[0]) == 24 and runs[0] == runs[1] == runs[2]


def test_all_pages_return_after_generation(model):
    gen = OfflineGenerator(model, page_size=3)
    free = gen.pool.allocator.num_free
    gen.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, max_new_tokens=5))
    assert gen.pool.allocator.num_free == free


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True)
    gen = OfflineGenerator(model)
    assert gen.generate(PROMPT, params).token_ids == gen.generate(PROMPT, params).token_ids


@pytest.mark.parametrize(
    "prompt, message", [([], "empty"), ([1] * 600, "max_position_embeddings"), ([10**6], "vocab")]
)
def test_bad_prompts(model, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        OfflineGenerator(model).generate(prompt, SamplingParams(temperature=0.0))


def test_fp8_checkpoint_matches_its_dequantized_twin(tmp_path):
    fp8_dir = make_tiny_model(tmp_path / "fp8", seed=2, fp8=True)
    fp8_model = DeepseekModel.from_pretrained(fp8_dir, dtype=torch.float32, progress=False)

    # The twin: the same weights dequantized by hand and stored as plain float32.
    from safetensors.torch import load_file

    raw = load_file(str(fp8_dir / "model.safetensors"))
    plain = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        scale = raw.get(name + "_scale_inv")
        plain[name] = t.float() if scale is None else dequantize_fp8_blockwise(t, scale, (128, 128))
    assert any(t.dtype == torch.float8_e4m3fn for t in raw.values())
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (twin_dir / f).write_bytes((fp8_dir / f).read_bytes())
    import json

    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    (twin_dir / "config.json").write_text(json.dumps(cfg))
    save_checkpoint(twin_dir, plain)
    twin = DeepseekModel.from_pretrained(twin_dir, dtype=torch.float32, progress=False)

    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    a = OfflineGenerator(fp8_model).generate(PROMPT, params).token_ids
    b = OfflineGenerator(twin).generate(PROMPT, params).token_ids
    assert a == b
    torch.testing.assert_close(_prefill_logits(fp8_model, 8), _prefill_logits(twin, 8))
