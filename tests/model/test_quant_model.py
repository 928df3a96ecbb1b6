"""The model with its weights in int8 (W8A8) and fp8 (weight-only) against the same checkpoint in
bf16, on the tiny model, teacher-forced: the bf16 model is the oracle. Plus the FP8-checkpoint
paths (kept as stored, re-quantized to int8) and the one-line errors for a scheme a checkpoint
cannot run in."""

import weakref

import pytest
import torch
from quant_checkpoints import fp8_checkpoint_with_blocks

from control.model_config import ModelConfig
from control.sampling_params import SamplingParams
from model.checkpoint_reader import CheckpointReader
from model.deepseek import DeepseekModel
from model.quant import QuantizationError
from model.weight_names import checkpoint_shapes
from native import ops
from runtime.generate import OfflineGenerator
from tinymodel.make import make_tiny_model

STEPS = 32
# Bounds over the 33 teacher-forced positions of the tiny random model. Measured: int8 median
# relative logit error 0.021, mean KL 0.0007, agreement 1.0; fp8 0.052, 0.012, 1.0. The median,
# not the max: a perturbation that flips a near-tie expert choice changes one position's logits
# a lot (fp8 flips one route here, 0.57 at that position), which is quantization, not a bug. A
# wrong scale or layout gives errors near 1 everywhere and agreement near chance.
# int4 (4-bit MLPs and experts, int8 attention): 0.175, 0.13, 0.97: every group of this model
# is a whole 64-input row, and random weights have no outliers to spare.
MEDIAN_REL_ERR = {"int8": 0.06, "fp8": 0.12, "int4": 0.3}
MEAN_KL = {"int8": 0.01, "fp8": 0.05, "int4": 0.3}
AGREEMENT = 0.9

needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")


def _load(model_dir, quant=None, dtype=torch.bfloat16) -> DeepseekModel:
    return DeepseekModel.from_pretrained(model_dir, dtype, progress=False, quant=quant)


def _teacher_forced_logits(model: DeepseekModel, prompt: list[int], forced: list[int]):
    """[len(forced) + 1, V] fp32: the logits after the prompt, then after each forced token."""
    gen = OfflineGenerator(model)
    table = gen.pool.new_table()
    try:
        rows = [gen.prefill(table, prompt)]
        for i, token in enumerate(forced):
            rows.append(gen.decode(table, token, len(prompt) + i))
    finally:
        gen.pool.release(table)
    return torch.stack(rows)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The random tiny model (seed 0), which the bounds above were measured on; its head's
    wide logit margins keep greedy choices stable (the trained default's fp8 agreement is 0.88)."""
    return make_tiny_model(tmp_path_factory.mktemp("random"), seed=0)


@pytest.fixture(scope="module")
def bf16_run(tiny_dir):
    """The bf16 model's greedy continuation of a prompt and its teacher-forced logits."""
    model = _load(tiny_dir)
    prompt = list(range(3, 40, 2))
    result = OfflineGenerator(model).generate(
        prompt, SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
    )
    assert len(result.token_ids) == STEPS
    return prompt, result.token_ids, _teacher_forced_logits(model, prompt, result.token_ids)


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
def test_quantized_logits_follow_bf16(tiny_dir, bf16_run, quant):
    prompt, forced, want = bf16_run
    model = _load(tiny_dir, quant)
    assert model.quant == quant
    got = _teacher_forced_logits(model, prompt, forced)
    rel_err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
    log_p, log_q = want.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel_err < MEDIAN_REL_ERR[quant], rel_err
    assert kl.mean().item() < MEAN_KL[quant], kl
    assert agreement >= AGREEMENT, agreement
    assert rel_err > 0.002  # the weights really are quantized (bf16 gives 0)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fp8"), fp8=True, dtype=torch.bfloat16)


@needs_native
def test_fp8_checkpoint_is_kept_as_stored(fp8_dir):
    """quant = "fp8" on an FP8 checkpoint packs its bytes and scales as they are in the file
    (no dequantize / re-quantize round trip), and runs like the dequantized bf16 model."""
    cfg = ModelConfig.from_model_dir(fp8_dir)
    name = "model.layers.1.self_attn.q_a_proj.weight"
    shapes = checkpoint_shapes(cfg)
    with CheckpointReader(fp8_dir, shapes, torch.bfloat16, (128, 128), keep_stored=True) as reader:
        raw = reader.pop(name)
    model = _load(fp8_dir, "fp8")
    weight, scale = model.layers[1].attn.q_a_proj.weight.unpack()
    assert torch.equal(weight.view(torch.uint8), raw.weight.view(torch.uint8))
    assert torch.equal(scale, raw.scale_inv)

    prompt = list(range(5, 30))
    reference = _teacher_forced_logits(_load(fp8_dir), prompt, [7, 8, 9])
    got = _teacher_forced_logits(model, prompt, [7, 8, 9])
    rel_err = ((got - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()
    assert rel_err < 0.03, rel_err  # the same weights; bf16 rounding of the dequantized copy


def test_fp8_checkpoint_requantized_to_int8(fp8_dir):
    prompt = list(range(5, 30))
    want = _teacher_forced_logits(_load(fp8_dir), prompt, [7, 8, 9])
    got = _teacher_forced_logits(_load(fp8_dir, "int8"), prompt, [7, 8, 9])
    rel_err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
    assert 0.002 < rel_err < MEDIAN_REL_ERR["int8"], rel_err


@needs_native
def test_fp8_gate_rows_off_the_block_are_padded_exactly(tmp_path):
    """Dense gate/up run as one GEMM; from an FP8 checkpoint whose gate has 96 rows a 128-row
    block would straddle gate and up, so both are zero-padded to 128 rows (down to 128 columns):
    the same result as the dequantized model, the stored bytes kept."""
    model_dir = make_tiny_model(tmp_path, fp8=True, overrides={"intermediate_size": 96})
    model = _load(model_dir, "fp8")
    w13 = model.layers[0].mlp.w13.weight
    assert tuple(w13.shape) == (2 * 128, 64)  # [gate 96 + 32 zero rows | up 96 + 32]
    weight = w13.unpack()[0].view(torch.uint8)
    assert not weight[96:128].any() and not weight[128 + 96 :].any()
    prompt = list(range(5, 30))
    want = _teacher_forced_logits(_load(model_dir), prompt, [7, 8, 9])
    got = _teacher_forced_logits(model, prompt, [7, 8, 9])
    rel_err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel_err < 0.03, rel_err


def test_fp8_blocks_other_than_128_are_refused_for_fp8(tmp_path):
    """An FP8 checkpoint with 64x64 blocks: the fp8 kernels take 128x128 as stored, so fp8
    refuses in one line naming the key and the blocks; int8 (which dequantizes) loads it."""
    model_dir = fp8_checkpoint_with_blocks(tmp_path / "fp8-64", (64, 64))
    with pytest.raises(QuantizationError, match=r'quant = "fp8".*\[64, 64\]') as err:
        _load(model_dir, "fp8")
    assert "\n" not in str(err.value) and "128x128" in str(err.value)
    assert _load(model_dir, "int8").quant == "int8"


def test_bad_quant_names_and_dtypes(tiny_dir):
    from control.errors import ConfigError

    with pytest.raises(ConfigError, match="quant must be one of none, int8, fp8, int4, got 'int3'"):
        _load(tiny_dir, "int3")
    with pytest.raises(QuantizationError, match='quant = "int8" needs dtype bfloat16'):
        _load(tiny_dir, "int8", dtype=torch.float32)


@needs_native
@pytest.mark.parametrize("quant", [None, "int8", "fp8", "int4"])
def test_loading_holds_one_matrix_in_flight(tiny_dir, quant, monkeypatch):
    """Every tensor the model pops is freed once packed: when each tensor is read, at most three
    earlier popped tensors (one MLP's gate, up and down, or an expert's) are still alive.
    Tensors the model keeps as read (norms, the embedding) are not counted."""
    alive: list[weakref.ref] = []
    most = 0
    real_pop = CheckpointReader.pop

    def pop(self, name):
        nonlocal most
        most = max(most, sum(ref() is not None for ref in alive))
        tensor = real_pop(self, name)
        if tensor.dim() == 2:  # a matrix (the norms, 1-D, are kept as read)
            alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(CheckpointReader, "pop", pop)
    model = _load(tiny_dir, quant)
    assert len(alive) > 20  # the projections and experts were popped, one by one
    assert most <= 3, most
    assert model.quant == (quant or "none")
