"""Our DeepSeek model (reference ops, fp32) against Hugging Face transformers on the same random
checkpoints: prefill logits, then 16 greedy decode steps through our paged cache."""

import pytest
import torch

from model.deepseek import DeepseekModel
from native import ops
from runtime.generate import OfflineGenerator
from tinymodel.builder import V2_LITE_OVERRIDES
from tinymodel.make import make_tiny_model

transformers = pytest.importorskip("transformers")

V2_LITE = V2_LITE_OVERRIDES

VARIANTS = {
    # q_lora_rank set, sigmoid + correction bias, n_group 2, YaRN, first layer dense.
    "v3": {},
    "v3_no_dense_layer": {"first_k_dense_replace": 0},
    "v2_lite": V2_LITE,
    "v2_group_limited_no_dense": {
        **V2_LITE,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 0,
    },
}

PROMPT = [1, 17, 33, 250, 7, 99, 121, 5, 64, 300, 12, 41, 77]
DECODE_STEPS = 16


def _hf_model(model_dir, model_type):
    cls = {
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
    }[model_type]
    model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-4 * scale, f"{what}: max error {err:.3g} vs logit scale {scale:.3g}"


@pytest.fixture(autouse=True)
def reference_ops():
    """This file tests the model math; the kernels are compared with the reference elsewhere."""
    was = ops.native_available()
    ops.set_native_enabled(False)
    yield
    ops.set_native_enabled(was)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_decode_match_transformers(tmp_path, variant):
    overrides = VARIANTS[variant]
    model_dir = make_tiny_model(tmp_path / variant, seed=3, overrides=overrides)
    ours = DeepseekModel.from_pretrained(model_dir, dtype=torch.float32, progress=False)
    theirs = _hf_model(model_dir, ours.cfg.model_type)

    gen = OfflineGenerator(ours, page_size=3, chunk_size=5)
    table = gen.pool.new_table()
    logits = gen.prefill(table, PROMPT)
    tokens = list(PROMPT)
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            expected = theirs(torch.tensor([tokens])).logits[0, -1]
            _assert_close(logits, expected, f"{variant} step {step}")
            assert logits.argmax().item() == expected.argmax().item()
            if step == DECODE_STEPS:
                break
            token = int(expected.argmax())
            tokens.append(token)
            logits = gen.decode(table, token, len(tokens) - 1)
    gen.pool.release(table)
