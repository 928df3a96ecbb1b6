"""The MTP draft head (model/draft_head.py, `DeepseekModel.set_draft_head`): each scheme's copy
of the LM head against the plain-torch twins of its kernel, and speculative decoding with it
against plain decoding (the oracle: the output may not change, whatever the drafts are)."""

from __future__ import annotations

import pytest
import torch

from control.cluster_config import ClusterConfig
from control.errors import ConfigError
from control.quant_schemes import DEFAULT_DRAFT_HEAD, INT4_GROUP_SIZE
from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from model.draft_head import draft_head, float_weight
from model.quant import Linear
from native import ops, reference, reference_int4
from runtime.generate import OfflineGenerator
from runtime.speculative_generate import SpeculativeGenerator
from tinymodel.make import make_tiny_model

needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")
PROMPTS = [[1, 5, 9, 30, 2, 7, 8, 100, 200, 3, 4, 17, 250], list(range(40, 61))]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("mtp"), seed=11, overrides={"num_nextn_predict_layers": 1}
    )


def _head(dtype, int8: bool = False) -> tuple[Linear, torch.Tensor]:
    """A head [96, 128] as a model holds it, and the float weight it was made from."""
    torch.manual_seed(3)
    weight = torch.randn(96, 128).to(dtype)
    if int8:
        return Linear(ops.prepack_linear_int8(weight), ops.linear_int8), weight
    return Linear(ops.prepack_linear(weight), ops.linear), weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_scheme_runs_its_kernel_on_the_heads_weights(dtype):
    head, weight = _head(dtype)
    x = torch.randn(3, 128).to(dtype)
    assert draft_head(head, "none") is head
    assert torch.equal(float_weight(head.weight), weight)
    # int8: the twin of ops.linear_int8 on the weight's per-row int8 quantization.
    got = draft_head(head, "int8")(x).float()
    want = reference.linear_int8(x, reference.quantize_weight_int8(weight)).float()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
    # int4: the twin of ops.linear_int4 on the per-group int4 quantization.
    got = draft_head(head, "int4")(x).float()
    quantized = reference_int4.quantize_weight_int4(weight.float(), INT4_GROUP_SIZE)
    want = reference_int4.linear_int4(x, quantized).float()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
    # and 4 bits are not 8: the copies differ from each other and from the head
    assert not torch.equal(draft_head(head, "int4")(x), draft_head(head, "int8")(x))


def test_an_int8_head_is_its_own_int8_draft_and_dequantizes_for_int4():
    head, weight = _head(torch.bfloat16, int8=True)
    assert draft_head(head, "int8") is head
    q, scale = head.weight.unpack() if ops.native_available() else head.weight
    dequantized = float_weight(head.weight)
    assert torch.equal(dequantized, q.float() * scale[:, None])
    # within int8's rounding of the bf16 weight (half a step of each row's scale)
    assert ((dequantized - weight.float()).abs() <= scale[:, None] / 2 + 1e-6).all()
    x = torch.randn(2, 128).bfloat16()
    quantized = reference_int4.quantize_weight_int4(dequantized, INT4_GROUP_SIZE)
    want = reference_int4.linear_int4(x, quantized).float()
    got = draft_head(head, "int4")(x).float()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_a_bad_scheme_is_a_config_error():
    head, _ = _head(torch.bfloat16)
    with pytest.raises(ConfigError, match="mtp_draft_head must be one of none, int8, int4"):
        draft_head(head, "fp8")
    raw = {"prefill": [{"name": "p"}], "decode": [{"name": "d", "mtp_draft_head": "int2"}]}
    with pytest.raises(ConfigError, match="node d: mtp_draft_head must be one of"):
        ClusterConfig.from_dict(raw)


@needs_native
def test_the_model_drafts_through_the_default_copy_and_switches(mtp_dir):
    model = DeepseekModel.from_pretrained(mtp_dir, torch.bfloat16, progress=False, mtp=True)
    assert model.draft_head_scheme == DEFAULT_DRAFT_HEAD == "int4"
    assert isinstance(model.draft_lm_head.weight, ops.PackedLinearInt4)
    model.set_draft_head("none")
    assert model.draft_lm_head is None  # forward_mtp then runs `lm_head` itself
    model.set_draft_head("int8")
    assert isinstance(model.draft_lm_head.weight, ops.PackedLinearInt8)
    plain = DeepseekModel.from_pretrained(mtp_dir, torch.bfloat16, progress=False)
    assert plain.draft_lm_head is None
    with pytest.raises(RuntimeError, match="without its MTP layer"):
        plain.set_draft_head("int4")


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculative_greedy_output_is_plain_decodings_whatever_the_draft_head(
    mtp_dir, scheme, dtype
):
    model = DeepseekModel.from_pretrained(mtp_dir, dtype, progress=False, mtp=True)
    model.set_draft_head(scheme)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    plain = OfflineGenerator(model, page_size=4)
    spec = SpeculativeGenerator(model, 2, page_size=4)
    for prompt in PROMPTS:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    assert spec.num_steps > 0  # it did speculate
