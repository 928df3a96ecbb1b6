"""A packed weight store round trip on every kernel path: the model mapped from a pack computes
bit-identical logits to the model packed in the heap, for each scheme; the pack is made once
(its layout does not depend on the ISA) and mapped under each ISA. And the checksum op against
its reference twin."""

import pytest
import torch

from model.deepseek import DeepseekModel
from model.pack_cache import build_pack, load_model, pack_spec
from native import ops, reference
from runtime.generate import OfflineGenerator
from tinymodel.make import make_tiny_model

SCHEMES = ("none", "int8", "fp8", "int4")


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """The random tiny model and one pack per scheme, made on the best ISA."""
    root = tmp_path_factory.mktemp("packs")
    model_dir = make_tiny_model(root / "model", seed=1)
    out = {}
    for quant in SCHEMES:
        out[quant] = root / f"{quant}.pack"
        build_pack(model_dir, out[quant], pack_spec(model_dir, torch.bfloat16, quant), False)
    return model_dir, out


def _logits(model: DeepseekModel) -> torch.Tensor:
    """A chunked prefill over a cached prefix, then two decode steps: every op kind runs."""
    gen = OfflineGenerator(model, page_size=4, chunk_size=8)
    table = gen.pool.new_table()
    prompt = [(7 * i + 3) % model.cfg.vocab_size for i in range(19)]
    rows = [gen.prefill(table, prompt)]
    for i, token in enumerate((5, 9)):
        rows.append(gen.decode(table, token, len(prompt) + i))
    gen.pool.release(table)
    return torch.stack(rows)


@pytest.mark.parametrize("quant", SCHEMES)
def test_mapped_logits_equal_heap_logits(isa, packs, quant):
    model_dir, pack = packs
    heap = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False, quant=quant)
    mapped = load_model(model_dir, torch.bfloat16, quant, progress=False, pack=pack[quant])
    assert mapped.weights_backing.startswith("file")
    assert torch.equal(_logits(heap), _logits(mapped))


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 1000, (1 << 20) + 77, 3 << 20])
def test_checksum_equals_reference(isa, nbytes):
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    assert ops.checksum(data) == reference.checksum(data)


def test_checksum_sees_every_word_and_the_order(isa):
    data = torch.randint(
        0, 256, (2 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    base = ops.checksum(data)
    for i in (0, 7, 64, (1 << 20) - 1, (1 << 20) + 5, data.numel() - 1):
        flipped = data.clone()
        flipped[i] ^= 1
        assert ops.checksum(flipped) != base
    words = data.view(torch.int64).clone()
    words[[3, 11]] = words[[11, 3]]  # two words swapped (lanes differ)
    assert ops.checksum(words) != base
    words = data.view(torch.int64).clone()
    words[[3, 19]] = words[[19, 3]]  # two rows of the same lane swapped
    assert ops.checksum(words) != base
