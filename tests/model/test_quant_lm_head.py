"""The LM head in int8 W8A8 (`quant_lm_head`, model.quant): its logits against a plain-torch
oracle, the whole model against the same model with a dequantized head, the accuracy it costs
on the trained tiny model's held-out text, the flag off changing nothing, the config key, and
packs of one head scheme never mapped as the other."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from control.cluster_config import ClusterConfig, DecodeNodeConfig, PrefillNodeConfig
from control.errors import ConfigError
from control.model_config import ModelConfig
from control.tokenizer import Tokenizer
from model.batch import ForwardBatch
from model.deepseek import DeepseekModel
from model.pack_cache import build_pack, ensure_cached_pack, load_model, pack_spec
from model.quant import Linear, QuantizationError, quantizer
from model.weight_pack import PackError, PackSpec
from native import ops
from tinymodel.make import ensure_tiny_model, make_tiny_model
from tinymodel.train_data import load_corpus

needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")

# Held-out text for the accuracy bounds: the first 64 tokens of the first 8 held-out stdlib files
# (files the trained tiny model never saw), every position's next-token distribution: 512.
HELD_OUT_FILES, HELD_OUT_TOKENS = 8, 64


def _load(model_dir, dtype=torch.bfloat16, **kwargs) -> DeepseekModel:
    return DeepseekModel.from_pretrained(model_dir, dtype, progress=False, **kwargs)


def _every_position(model: DeepseekModel, ids: list[int], mtp: bool = False):
    """[T, V] fp32 logits of every position of `ids` (one extend forward); with `mtp` also the
    MTP layer's [T - 1, V] over the same positions, fed the tokens one ahead."""
    pool = model.new_kv_pool(num_pages=len(ids) // 16 + 2, page_size=16)
    table = pool.new_table()
    pool.reserve(table, len(ids))
    batch = ForwardBatch.build(pool, [table], [ids], [0], is_decode=False)
    batch.extra_logit_index = torch.arange(len(ids) - 1)
    out, hidden = model.forward_with_hidden(batch, pool)
    logits = torch.cat((out[1:], out[:1]))  # positions 0 .. T-1
    if not mtp:
        return logits
    ahead = ForwardBatch.build(pool, [table], [ids[1:]], [0], is_decode=False)
    ahead.extra_logit_index = torch.arange(len(ids) - 2)
    out, _ = model.forward_mtp(ahead, hidden[:-1], pool)
    return logits, torch.cat((out[1:], out[:1]))


def _is_dense(head: Linear) -> bool:
    """Whether `head` is the model-dtype projection (`ops.prepack_linear`, `ops.linear`)."""
    packed = ops.prepack_linear(torch.zeros(16, 16, dtype=torch.bfloat16))
    return head._op is ops.linear and type(head.weight) is type(packed)


def _oracle_weight(weight: torch.Tensor):
    """Per-row symmetric int8 of the head weight [V, D]: scale = max|w| / 127 per output row
    (fp32), q = w / scale rounded to nearest (ties to even), the quotient taken exactly (float64).
    -> (q int64, scale fp32, ties bool: where w / scale is exactly k + 1/2). At a tie an fp32
    computation of the quotient (the kernel's w * (127 / max|w|)) may land on either side: the
    checkpoint's weights are bf16 numbers, so ties occur (547 of the trained head's 131072
    values, 21 of which the kernel rounds the other way)."""
    w = weight.double()
    exact = w * 127 / w.abs().amax(dim=1, keepdim=True)
    q = torch.round(exact).clamp(-127, 127).long()
    ties = exact - exact.floor() == 0.5
    return q, weight.float().abs().amax(dim=1) / 127, ties


def _oracle_tokens(x: torch.Tensor):
    """Per-token int8 of the activations [M, D] as native/reference.py's `linear_int8` does it:
    scale = max|x| / 127, q = round(x * (127 / max|x|)), both divisions correctly rounded fp32.
    -> (q int64, scale fp32)."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    c127 = torch.full_like(absmax, 127.0)
    q = torch.round(xf * (c127 / absmax)[:, None]).clamp(-127, 127).long()
    return q, absmax / c127


def _oracle_logits(weight: torch.Tensor, x: torch.Tensor):
    """The int8 head's logits [M, V] in fp32 (exact integer dot products, times the token's and
    the row's scales) and how far a tie rounded the other way may move each: one weight step
    (the row's scale) times the token's |q| at each tie of the row, times the token's scale."""
    qw, sw, ties = _oracle_weight(weight)
    qx, sx = _oracle_tokens(x)
    logits = (qx @ qw.T).float() * sx[:, None] * sw[None, :]
    slack = (qx.abs() @ ties.long().T).float() * sx[:, None] * sw[None, :]
    return logits, slack


@pytest.fixture(scope="module")
def trained():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def head_weight(trained):
    """The trained model's head as the checkpoint stores it (fp32)."""
    from safetensors.torch import load_file

    return load_file(str(trained / "model.safetensors"))["lm_head.weight"]


@pytest.fixture(scope="module")
def held_out(trained):
    tok = Tokenizer(trained)
    texts = load_corpus().held_out[:HELD_OUT_FILES]
    return [tok.encode_prompt(text)[:HELD_OUT_TOKENS] for text in texts]


@pytest.fixture(scope="module")
def bf16_pair(trained):
    """The trained model in bf16 with its MTP layer: the model-dtype head, and the int8 one;
    the MTP layer drafts through that head too (not a copy: `model.draft_head`)."""
    pair = _load(trained, mtp=True), _load(trained, mtp=True, quant_lm_head=True)
    for model in pair:
        model.set_draft_head("none")
    return pair


# ---- the head against its oracle ---------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_head_matches_the_plain_torch_oracle(trained, head_weight, dtype, native):
    """The loaded model's head on activations of the hidden size (normal rows, and one with an
    outlier that sets its row's scale alone) against `_oracle_logits` of the head weight as the
    model holds it (cast to `dtype`). Tolerance: the oracle's tie slack (exact), plus the
    rounding of the result to `dtype` relative to its magnitude, at most |logit| + slack (bf16:
    2^-8; fp32: 1e-5 for the epilogue's order of operations), plus 1e-6. Measured: within it
    everywhere, native and reference alike; without the tie slack the worst logit is off by
    0.4 % of the largest (a tie at the outlier). A per-tensor weight scale instead of per row
    exceeds the tolerance by 0.29 (the largest logit here is 36)."""
    if native and not ops.native_available():
        pytest.skip("no kernels")
    ops.set_native_enabled(native)
    try:
        model = _load(trained, dtype, quant_lm_head=True)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, head_weight.shape[1], generator=gen)
        x[3, 7] = 40.0
        x = x.to(dtype)
        got = model.lm_head(x).float()
    finally:
        ops.set_native_enabled(True)
    assert model.lm_head_quant == "int8"
    want, slack = _oracle_logits(head_weight.to(dtype), x)
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    excess = (got - want).abs() - (rtol * (want.abs() + slack) + slack + 1e-6)
    assert excess.max().item() <= 0, excess.max().item()
    # and it is not the unquantized product: the weight's rounding shows
    dense = x.float() @ head_weight.to(dtype).float().T
    assert (got - dense).abs().max() > 0.005 * dense.abs().max()


def test_the_model_with_an_int8_head_is_the_model_with_its_dequantized_head(
    trained, head_weight, held_out, bf16_pair
):
    """Every logit of the flag-on model, main head and MTP layer's (the same head), over two
    held-out files (128 positions):

    - equals the oracle on the head's own input (recorded), within the oracle test's tolerance:
      the model feeds the head what it should and returns what it gives;
    - is within a relative 0.03 (L2, per position) of the flag-off model whose head is the
      oracle's dequantized int8 copy (q * scale per row, an fp32 matmul): the hidden states
      are the same, so what differs is the int8 head's per-token activation rounding and the
      bf16 rounding of its result. Measured at most 0.0076 (main) and 0.0123 (MTP)."""
    base, quantized = bf16_pair
    qw, sw, _ = _oracle_weight(head_weight.to(torch.bfloat16))
    dequantized = qw.float() * sw[:, None]
    seen = []
    head = quantized.lm_head
    saved = base.lm_head, head
    base.lm_head = Linear(dequantized, lambda x, w: x.float() @ w.T)
    quantized.lm_head = Linear(head, lambda x, h: seen.append(x) or h(x))
    try:
        for ids in held_out[:2]:
            want, want_mtp = _every_position(base, ids, mtp=True)
            seen.clear()
            got, got_mtp = _every_position(quantized, ids, mtp=True)
            for g, w in ((got, want), (got_mtp, want_mtp)):
                rel = ((g - w).norm(dim=-1) / w.norm(dim=-1)).max().item()
                assert rel < 0.03, rel
            for out, x in zip((got, got_mtp), seen, strict=True):
                oracle, slack = _oracle_logits(head_weight.to(torch.bfloat16), x)
                oracle = torch.cat((oracle[1:], oracle[:1]))  # rows as `_every_position`'s
                slack = torch.cat((slack[1:], slack[:1]))
                excess = (out - oracle).abs() - (2**-8 * (oracle.abs() + slack) + slack + 1e-6)
                assert excess.max().item() <= 0, excess.max().item()
    finally:
        base.lm_head, quantized.lm_head = saved  # the fixture's models as they were


def test_int8_head_accuracy_on_held_out_text(held_out, bf16_pair):
    """KL(bf16 head || int8 head) of the next-token distributions and top-1 agreement, the
    trained tiny model in bf16, over 512 held-out positions (8 stdlib files the model never
    saw, 64 tokens each). Measured on an Intel Xeon (AVX-512 kernels): mean KL 1.2e-4, max
    6.0e-4, top-1 agreement 0.998 (one flip in 512, where the bf16 head's top two were 0.169
    and 0.164); over all 16 held-out files x 128 tokens (1999 positions) mean KL 1.2e-4, max
    1.1e-3, agreement 0.988. For scale, the same model in bf16 against fp32 measures mean KL
    6.2e-4 and agreement 0.984 there: the int8 head costs less than bf16 itself. The trained
    weights differ a little between CPUs (test_mtp_trained), so the bounds leave room: mean KL
    < 1e-3 (8x), max < 1e-2 (16x), agreement >= 0.97 (15 flips in 512)."""
    base, quantized = bf16_pair
    kl, agree = [], []
    for ids in held_out:
        log_p = _every_position(base, ids).log_softmax(-1)
        log_q = _every_position(quantized, ids).log_softmax(-1)
        kl.append((log_p.exp() * (log_p - log_q)).sum(-1))
        agree.append(log_p.argmax(-1) == log_q.argmax(-1))
    kl, agree = torch.cat(kl), torch.cat(agree).float()
    assert kl.numel() == HELD_OUT_FILES * HELD_OUT_TOKENS
    assert kl.mean().item() < 1e-3, kl.mean().item()
    assert kl.max().item() < 1e-2, kl.max().item()
    assert agree.mean().item() >= 0.97, agree.mean().item()
    assert kl.mean().item() > 1e-7  # the head really is quantized (the same head gives 0)


# ---- the flag off, other dtypes, a tied head ---------------------------------------------
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_the_flag_off_keeps_the_dense_model_dtype_head(trained, held_out, quant):
    """Off (the default), whatever `quant` is, the head is the model-dtype dense projection
    (`ops.linear` on `ops.prepack_linear`'s packing) and the logits are bit for bit those of a
    model loaded without the argument."""
    default = _load(trained, quant=quant)
    off = _load(trained, quant=quant, quant_lm_head=False)
    for model in (default, off):
        assert model.lm_head_quant == "none" and _is_dense(model.lm_head)
    ids = held_out[0][:24]
    assert torch.equal(_every_position(default, ids), _every_position(off, ids))


def test_int8_head_needs_a_dtype_its_kernel_takes(trained):
    with pytest.raises(QuantizationError, match="quant_lm_head = true needs dtype bfloat16 or "):
        quantizer("none", torch.float16, quant_lm_head=True)
    with pytest.raises(QuantizationError, match="quant_lm_head must be true or false"):
        quantizer("none", torch.bfloat16, quant_lm_head="yes")
    assert quantizer("fp8", torch.bfloat16, quant_lm_head=True).head_scheme == "int8"
    assert _load(trained, quant="fp8", quant_lm_head=True).lm_head_quant == "int8"


def test_a_tied_head_goes_int8_and_the_embedding_stays(tmp_path):
    """tie_word_embeddings: the head is the embedding matrix; with the flag it is quantized into
    a copy of its own, the lookup keeps the model-dtype rows. Relative logit error against the
    model-dtype head measured 0.007 to 0.010 per position (random seed-2 model); bounded at 0.03."""
    model_dir = make_tiny_model(tmp_path / "tied", seed=2, overrides={"tie_word_embeddings": True})
    dense, int8 = _load(model_dir), _load(model_dir, quant_lm_head=True)
    assert int8.lm_head_quant == "int8" and int8.lm_head._op is ops.linear_int8
    assert _is_dense(dense.lm_head)
    assert torch.equal(int8.embed_tokens, dense.embed_tokens)
    assert int8.embed_tokens.dtype == torch.bfloat16
    ids = list(range(5, 29))
    want, got = _every_position(dense, ids), _every_position(int8, ids)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert 1e-4 < rel < 0.03, rel


# ---- config, CLI, resources ------------------------------------------------------------------
def test_the_config_key_is_read_off_by_default_and_checked():
    def cfg(prefill=None, decode=None):
        return ClusterConfig.from_dict(
            {
                "prefill": [{"name": "p", **(prefill or {})}],
                "decode": [{"name": "d", **(decode or {})}],
            }
        )

    default = cfg()
    assert not default.prefill[0].quant_lm_head and not default.decode[0].quant_lm_head
    on = cfg({"quant_lm_head": True}, {"quant_lm_head": True, "quant": "int8"})
    assert on.prefill[0].quant_lm_head and on.decode[0].quant_lm_head
    f32 = ClusterConfig.from_dict(
        {"dtype": "float32", "prefill": [{"name": "p", "quant_lm_head": True}],
         "decode": [{"name": "d"}]}
    )  # fmt: skip
    assert f32.prefill[0].quant_lm_head  # the int8 kernel takes fp32 activations too
    for bad in ("yes", 1):
        with pytest.raises(ConfigError, match=r"\[prefill.p\] quant_lm_head must be bool"):
            cfg({"quant_lm_head": bad})
        with pytest.raises(ConfigError, match=r"\[decode.d\] quant_lm_head must be bool"):
            cfg(decode={"quant_lm_head": bad})


def test_node_loader_passes_the_flag(monkeypatch):
    from model import pack_cache
    from runtime import node_process

    seen = {}
    no_mtp = SimpleNamespace(mtp=None)  # what the loader goes on to ask of the model
    monkeypatch.setattr(pack_cache, "load_model", lambda *a, **kw: seen.update(kw) or no_mtp)
    monkeypatch.setattr(ops, "set_num_threads", lambda n: None)  # the loader sets the node's
    cluster = ClusterConfig.from_dict(
        {
            "model": "/m",
            "prefill": [{"name": "p"}],
            "decode": [{"name": "d", "quant_lm_head": True}],
        }
    )
    node_process.load_model(cluster, cluster.node("d"), None)
    assert seen["quant_lm_head"] is True
    node_process.load_model(cluster, cluster.node("p"), None)
    assert seen["quant_lm_head"] is False


def test_cli_flags_reach_the_loaders(trained, tmp_path, monkeypatch, capsys):
    """`duet generate --quant-lm-head` loads with it (both models when --prefill-quant and
    --decode-quant differ), `duet pack --quant-lm-head` writes an int8-head pack, and
    `duet up --quant-lm-head` sets it on every node."""
    from deploy.cli import main
    from deploy.local_cluster import parse_args, resolve_config
    from model import pack_cache
    from model.weight_pack import read_manifest

    loaded = []
    real = pack_cache.load_model
    monkeypatch.setattr(
        pack_cache,
        "load_model",
        lambda *a, **kw: loaded.append(kw["quant_lm_head"]) or real(*a, **kw),
    )
    argv = ["generate", "--model", str(trained), "--prompt", "def f", "--max-new-tokens", "2"]
    assert main([*argv, "--json", "--quant-lm-head", "--decode-quant", "int8"]) == 0
    assert main([*argv, "--json"]) == 0
    assert loaded == [True, True, False]
    capsys.readouterr()

    out = tmp_path / "head.pack"
    assert main(["pack", "--model", str(trained), "--out", str(out), "--quant-lm-head"]) == 0
    assert read_manifest(out)["spec"]["lm_head"] == "int8"

    raw = resolve_config(parse_args(["--prefill", "2", "--quant-lm-head"]))
    assert all(n["quant_lm_head"] for n in (*raw["prefill"], *raw["decode"]))
    raw = resolve_config(parse_args([]))
    assert not any(n.get("quant_lm_head") for n in (*raw["prefill"], *raw["decode"]))


def test_resources_count_the_int8_head(trained):
    from deploy.k8s_resources import node_resources, weight_bytes

    cfg = ModelConfig.from_model_dir(trained)
    v, d = cfg.vocab_size, cfg.hidden_size
    dense = weight_bytes(cfg, "bfloat16")
    assert weight_bytes(cfg, "bfloat16", quant_lm_head=True) == dense - 2 * v * d + v * d + 8 * v
    saved_per_rank = 2 * v * d - (v * d + 8 * v)  # the head's bf16 bytes less its int8 ones
    for off in (DecodeNodeConfig(name="d", ranks=2), PrefillNodeConfig(name="p")):
        on = dataclasses.replace(off, quant_lm_head=True)
        got = node_resources(cfg, "bfloat16", on).weight_bytes
        want = node_resources(cfg, "bfloat16", off).weight_bytes - off.ranks * saved_per_rank
        assert got == want


# ---- packs -----------------------------------------------------------------------------------
def test_the_head_scheme_is_part_of_a_packs_spec_and_key(trained):
    """A model-dtype head's spec is the one it was before heads had a scheme (its manifest and
    cache key name no `lm_head`, and a manifest without one reads as "none"); an int8 head's
    names it, so its key and every field comparison differ."""
    off = pack_spec(trained, torch.bfloat16, "none")
    on = pack_spec(trained, torch.bfloat16, "none", quant_lm_head=True)
    assert (off.lm_head, on.lm_head) == ("none", "int8")
    assert "lm_head" not in off.to_json() and on.to_json()["lm_head"] == "int8"
    assert PackSpec.from_json(off.to_json()) == off and PackSpec.from_json(on.to_json()) == on
    assert on.mismatch(off) == "lm_head is 'none', this process needs 'int8'"
    assert off.mismatch(on) == "lm_head is 'int8', this process needs 'none'"


@needs_native
def test_a_pack_of_one_head_scheme_is_never_mapped_as_the_other(trained, tmp_path, monkeypatch):
    """An explicit pack of either head is refused by a process of the other, naming the field;
    the weights cache keeps one pack per head scheme (the second load builds its own, it does
    not map the first); an int8-head pack maps to the heap model's logits exactly."""
    int8_pack, dense_pack = tmp_path / "int8head.pack", tmp_path / "dense.pack"
    build_pack(trained, int8_pack, pack_spec(trained, torch.bfloat16, "int8", quant_lm_head=True),
               progress=False)  # fmt: skip
    build_pack(trained, dense_pack, pack_spec(trained, torch.bfloat16, "int8"), progress=False)
    with pytest.raises(PackError, match="lm_head is 'int8', this process needs 'none'"):
        load_model(trained, torch.bfloat16, "int8", pack=int8_pack)
    with pytest.raises(PackError, match="lm_head is 'none', this process needs 'int8'"):
        load_model(trained, torch.bfloat16, "int8", pack=dense_pack, quant_lm_head=True)

    ids = list(range(3, 30))
    mapped = load_model(trained, torch.bfloat16, "int8", pack=int8_pack, quant_lm_head=True)
    heap = _load(trained, quant="int8", quant_lm_head=True)
    assert mapped.lm_head_quant == "int8" and mapped.weights_backing != "heap"
    assert torch.equal(_every_position(mapped, ids), _every_position(heap, ids))

    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    spec_on = pack_spec(trained, torch.bfloat16, "none", quant_lm_head=True)
    spec_off = pack_spec(trained, torch.bfloat16, "none")
    on = load_model(trained, torch.bfloat16, weights_cache=True, quant_lm_head=True)
    off = load_model(trained, torch.bfloat16, weights_cache=True)
    path_on = ensure_cached_pack(trained, spec_on, progress=False)
    path_off = ensure_cached_pack(trained, spec_off, progress=False)
    assert path_on != path_off and "int8head" in path_on.name
    assert sorted(p.name for p in path_on.parent.glob("*.pack")) == sorted(
        [path_on.name, path_off.name]
    )
    assert (on.lm_head_quant, off.lm_head_quant) == ("int8", "none")
    assert _is_dense(off.lm_head)
    assert torch.equal(_every_position(off, ids), _every_position(_load(trained), ids))
