"""The trained tiny model: the training twin equals the inference model, training learns
(loss, Python continuations, MTP accuracy far above the chance baselines), and is deterministic.

The one fully trained model is `ensure_tiny_model()`'s cached copy, shared by the suite; the
training tests themselves run a few dozen steps."""

import builtins
import io
import json
import keyword
import math
import tokenize

import pytest
import torch
from safetensors.torch import load_file

from control.model_config import ModelConfig
from control.sampling_params import SamplingParams
from control.tokenizer import Tokenizer
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.weight_names import checkpoint_shapes, mtp_copy_names, mtp_shapes
from runtime.generate import OfflineGenerator
from tinymodel import train as tiny_train
from tinymodel.builder import VERSION_FILE
from tinymodel.make import ensure_tiny_model, make_tiny_model
from tinymodel.train_model import prepare, training_key

PROMPTS = ["def parse(self, text):\n", "import os\n\n\nclass ", "    for i in range(", "try:\n"]
PYTHON_WORDS = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}
SMALL = tiny_train.TrainSettings(steps=40, batch=8, seq_len=64, warmup=5, lr=1e-2)


@pytest.fixture(scope="module")
def trained():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def trained_params(trained):
    return load_file(str(trained / "model.safetensors"))


@pytest.fixture(scope="module")
def prepared():
    """(tokenizer, cfg, raw config, train samples, held-out samples) at the default settings."""
    return prepare()


def test_cached_default_is_the_trained_model(trained, trained_params):
    info = json.loads((trained / VERSION_FILE).read_text())
    assert info["trained"] and info["key"] == training_key()
    cfg = ModelConfig.from_model_dir(trained)
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_hidden_layers == 3
    assert cfg.rope.kind == "yarn" and cfg.q_lora_rank and cfg.n_shared_experts
    expected = {**checkpoint_shapes(cfg), **mtp_shapes(cfg)}
    expected.update({c: expected[s] for c, s in mtp_copy_names(cfg).items()})
    assert {n: tuple(t.shape) for n, t in trained_params.items()} == expected
    for copy, source in mtp_copy_names(cfg).items():
        assert torch.equal(trained_params[copy], trained_params[source])
    for name, w in trained_params.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, w.to(torch.bfloat16).float()), f"{name} not bf16-exact"


def test_twin_logits_equal_the_inference_model(trained, trained_params):
    """The twin's logits at every position equal DeepseekModel's (fp32, extend path)."""
    cfg = ModelConfig.from_model_dir(trained)
    tok = Tokenizer(trained)
    ids = tok.encode_prompt("def parse(self, text):\n    return [w for w in text.split()]\n")
    model = DeepseekModel.from_pretrained(trained, dtype=torch.float32, progress=False)
    pool = model.new_kv_pool(num_pages=8, page_size=16)
    table = pool.new_table()
    pool.reserve(table, len(ids))
    batch = ForwardBatch.build(pool, [table], [ids], [0], is_decode=False)
    batch.extra_logit_index = torch.arange(len(ids) - 1)
    out = model.forward(batch, pool)  # the last position first, then positions 0..T-2
    ours = torch.cat((out[1:], out[:1]))
    twin = tiny_train.main_logits(trained_params, cfg, ids)
    assert twin.shape == (len(ids), cfg.vocab_size)
    torch.testing.assert_close(ours, twin, atol=1e-4, rtol=1e-4)
    mtp = tiny_train.mtp_logits(trained_params, cfg, ids)
    assert mtp.shape == (len(ids) - 1, cfg.vocab_size) and torch.isfinite(mtp).all()


def test_held_out_loss_and_mtp_accuracy(trained_params, prepared):
    """Held-out stdlib files: main loss far below ln(vocab) (the untrained model's), and the
    MTP head's top-1 accuracy on the token after next far above chance and above always
    guessing the most frequent token."""
    _, cfg, _, _, held_out = prepared
    figures = tiny_train.evaluate(trained_params, cfg, held_out[:64])
    # Measured (seed 0, Python 3.11.7): loss 3.95, MTP accuracy 0.236, most frequent token 0.085.
    assert figures["loss"] < 4.2 < math.log(cfg.vocab_size) - 3
    after_next = held_out[:64, 2:]
    majority = torch.bincount(after_next.flatten()).max().item() / after_next.numel()
    assert figures["mtp_accuracy"] > 0.18
    assert (
        figures["mtp_accuracy"] > 1.5 * majority and figures["mtp_accuracy"] > 100 / cfg.vocab_size
    )


def _python_share(text: str) -> tuple[float, int]:
    """(share of the NAME/OP tokens that are Python keywords, builtins or self/cls, their count);
    line by line, so a broken indent or string only ends its own line."""
    words = total = 0
    for line in text.splitlines():
        try:
            for t in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
                if t.type in (tokenize.NAME, tokenize.OP):
                    total += 1
                    words += t.type == tokenize.NAME and t.string in PYTHON_WORDS
        except (tokenize.TokenError, SyntaxError):
            continue
    return words / max(total, 1), total


def _continuations(model_dir) -> list[str]:
    model = DeepseekModel.from_pretrained(model_dir, dtype=torch.float32, progress=False)
    tok = Tokenizer(model_dir)
    generator = OfflineGenerator(model)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    return [tok.decode(generator.generate(tok.encode_prompt(p), params).token_ids) for p in PROMPTS]


def test_greedy_continuations_read_as_python(trained, tmp_path):
    """The served model continues Python prompts with Python: a high share of keywords and
    builtins among the tokens, far above the random model's (the chance baseline)."""
    ours = _python_share("\n".join(_continuations(trained)))
    chance = _python_share("\n".join(_continuations(make_tiny_model(tmp_path, seed=0))))
    # Measured: 0.48 of 82 tokens trained, 0.0 of 15 random.
    assert ours[1] >= 40 and ours[0] > 0.3
    assert ours[0] > 3 * chance[0] + 0.1


def test_short_training_learns_and_is_deterministic(prepared):
    _, cfg, _, data, held_out = prepared
    data, held_out = data[:, : SMALL.seq_len + 1], held_out[:16, : SMALL.seq_len + 1]
    a, history = tiny_train.train(cfg, data, seed=3, settings=SMALL, progress=False)
    b, _ = tiny_train.train(cfg, data, seed=3, settings=SMALL, progress=False)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    c, _ = tiny_train.train(cfg, data, seed=4, settings=SMALL, progress=False)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    # Measured: step 0 at 8.06 (ln(vocab) = 7.62), 40 steps reach 5.79 on held-out text.
    assert history[0] > math.log(cfg.vocab_size) - 0.5
    assert tiny_train.evaluate(a, cfg, held_out)["loss"] < 6.2


def test_random_model_with_an_mtp_layer(tmp_path):
    """Random mode covers the MTP tensors (and the copies) when the config asks for them; the
    main tensors are those of the same seed without MTP, and the model still loads."""
    with_mtp = make_tiny_model(tmp_path / "a", seed=2, overrides={"num_nextn_predict_layers": 1})
    plain = make_tiny_model(tmp_path / "b", seed=2)
    cfg = ModelConfig.from_model_dir(with_mtp)
    wa = load_file(str(with_mtp / "model.safetensors"))
    wb = load_file(str(plain / "model.safetensors"))
    assert set(wa) == set(wb) | set(mtp_shapes(cfg)) | set(mtp_copy_names(cfg))
    assert "model.layers.3.eh_proj.weight" in wa and "model.layers.3.mlp.gate.weight" in wa
    for name, w in wb.items():
        assert torch.equal(wa[name], w), name
    for copy, source in mtp_copy_names(cfg).items():
        assert torch.equal(wa[copy], wa[source])
    assert DeepseekModel.from_pretrained(with_mtp, dtype=torch.float32, progress=False)
