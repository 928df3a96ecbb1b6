"""bench-e2e on the tiny model: the batched prefill / decode it times against the offline
generator (the oracle), its teacher-forced log-probs against per-prefix prefills, the weight
bytes against a count from the checkpoint's header, the KL math against a hand computation, and
the command's rows (structure and internal consistency, no timing assertions)."""

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open

from bench.e2e import ROWS, apply_interleaved, check_args, kl_and_agreement, parse_args
from bench.e2e_worker import (
    decode_step,
    held_tensor_bytes,
    load_model,
    prefill_batch,
    teacher_forced_logprobs,
)
from control.quant_schemes import QUANT_SCHEMES
from control.sampling_params import SamplingParams
from deploy.cli import main as duet_main
from model.weight_names import keeps_fp32
from runtime.generate import OfflineGenerator


def test_kl_and_agreement_match_a_hand_computation():
    # Two positions over two tokens: the argmax differs at the first, agrees at the second.
    p = torch.tensor([[0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.7], [0.8, 0.2]], dtype=torch.float64)
    kl_0 = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)  # 0.19204
    kl_1 = 0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)  # 0.03669
    kl, agreement = kl_and_agreement(p.log(), q.log())
    assert kl == pytest.approx((kl_0 + kl_1) / 2, rel=1e-12)
    assert agreement == 0.5
    assert kl_and_agreement(p.log(), p.log()) == (0.0, 1.0)


class _Slotted:
    __slots__ = ("packed", "scale")

    def __init__(self, packed, scale):
        self.packed, self.scale = packed, scale


class _Plain:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_held_tensor_bytes_counts_each_storage_once():
    big = torch.zeros(100, dtype=torch.bfloat16)  # 200 bytes
    scale = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    other = torch.zeros(3, dtype=torch.int8)  # 3 bytes
    root = _Plain(
        a=_Slotted(big, scale),
        views=[big[10:20], big.view(10, 10)],  # views of `big`: no new storage
        nested={"x": (other, scale)},
        cos_sin=torch.zeros(1000),  # skipped by name
        again=None,
    )
    root.again = root  # a cycle
    assert held_tensor_bytes(root) == 200 + 40 + 3


def _packed_bytes(n: int, k: int) -> int:
    """bf16 bytes of a prepacked [n, k] weight: rows padded to 32, K to even (_gemm_ops)."""
    return -(-n // 32) * 32 * -(-k // 2) * 2 * 2


def test_weights_bytes_equal_a_count_from_the_checkpoint(model, tiny_dir):
    """What the bf16 model holds, from the checkpoint's shapes alone: packed projections (and
    lm_head), norms and embeddings in bf16, router tensors in fp32, and kv_b once more as the
    absorbed W_UK [H, Dn, L] / W_UV [H, L, Dv] of the decode path, prepacked per head as the
    linear weights [L, Dn] / [Dv, L]."""
    cfg = model.cfg
    heads, nope, latent, v = (
        cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    )  # fmt: skip
    absorbed = heads * (_packed_bytes(latent, nope) + _packed_bytes(v, latent))
    expected = 0
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if keeps_fp32(name):
                expected += math.prod(shape) * 4
            elif name.endswith(("_proj.weight", "_proj_with_mqa.weight", "lm_head.weight")):
                expected += _packed_bytes(*shape)
            else:
                expected += math.prod(shape) * 2
            if name.endswith("kv_b_proj.weight"):
                expected += absorbed
    assert held_tensor_bytes(model) == expected
    # The checkpoint is fp32: the bf16 model holds about half of it.
    size = (tiny_dir / "model.safetensors").stat().st_size
    assert 0.45 < expected / size < 0.65


def _prompts(vocab, batch, length, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def test_batched_prefill_and_decode_match_the_offline_generator(model, one_thread):
    """The TTFT / TPOT paths against OfflineGenerator: one prompt's last logits are identical
    (same chunks), a batch of two gives each prompt's logits and greedy tokens."""
    chunk = 8
    offline = OfflineGenerator(model, page_size=4, chunk_size=chunk)
    prompts = _prompts(model.cfg.vocab_size, 2, 20)
    pool = model.new_kv_pool(num_pages=64, page_size=4)
    alone = []
    for prompt in prompts:
        table = offline.pool.new_table()
        alone.append(offline.prefill(table, prompt))
        offline.pool.release(table)

    table = pool.new_table()
    pool.reserve(table, 20)
    assert torch.equal(prefill_batch(model, pool, [table], prompts[:1], chunk)[0], alone[0])
    pool.release(table)

    steps = 3
    tables = [pool.new_table() for _ in prompts]
    for t in tables:
        pool.reserve(t, 20 + steps)
    logits = prefill_batch(model, pool, tables, prompts, chunk)
    for row, ref in zip(logits, alone, strict=True):
        torch.testing.assert_close(row, ref, atol=2e-2, rtol=2e-2)
    tokens = [logits.argmax(-1).tolist()]
    for step in range(steps):
        tokens.append(decode_step(model, pool, tables, tokens[-1], 20 + step).argmax(-1).tolist())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert [t[i] for t in tokens] == offline.generate(prompt, greedy).token_ids


def test_teacher_forced_logprobs_match_prefills_of_each_prefix(model, one_thread):
    ids = _prompts(model.cfg.vocab_size, 1, 16, seed=4)[0]
    pool = model.new_kv_pool(num_pages=8, page_size=4)
    logprobs = teacher_forced_logprobs(model, pool, ids, chunk_size=6)
    assert logprobs.shape == (16, model.cfg.vocab_size)
    offline = OfflineGenerator(model, page_size=4, chunk_size=6)
    for pos in (0, 4, 5, 6, 11, 15):  # chunk starts, ends and inside
        table = offline.pool.new_table()
        ref = torch.log_softmax(offline.prefill(table, ids[: pos + 1]), dim=-1)
        offline.pool.release(table)
        torch.testing.assert_close(logprobs[pos], ref, atol=2e-2, rtol=2e-2)


SMALL = ["--prompt-len", "20", "--batch", "2", "--decode-steps", "3", "--repeats", "1"]
SMALL += ["--kl-tokens", "16", "--chunk-size", "8", "--threads", "1"]


def test_bench_e2e_rows_are_consistent(tiny_dir, model, capsys):
    rc = duet_main(
        ["bench-e2e", "--model", str(tiny_dir), "--quant", "none,none", "--json"] + SMALL
    )
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["quant"] for r in rows] == ["none", "none"]
    for r in rows:
        assert "error" not in r
        assert r["load_s"] > 0 and r["ttft_s"] > 0 and r["tpot_s"] > 0
        assert r["weights_bytes"] == held_tensor_bytes(model)  # a fresh load holds the same
        assert r["resident_bytes"] == r["rss_anon_bytes"] + r["rss_file_bytes"]
        assert 0 < r["base_rss_bytes"] and r["resident_bytes"] <= r["peak_bytes"]
        assert r["weights_ratio"] == 1.0
    ref, twin = rows
    assert "kl" not in ref  # the reference itself
    assert twin["kl"] == pytest.approx(0.0, abs=1e-9) and twin["top1_agreement"] == 1.0
    assert ref["prefill_speedup"] == ref["tpot_ratio"] == 1.0


def test_bench_e2e_table_and_a_failing_worker(tiny_dir, tmp_path, capsys):
    """A row whose worker fails (here: a model dir without weights) is one error line; the
    command still prints the table and exits 1."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    shutil.copy(tiny_dir / "config.json", broken / "config.json")
    argv = ["bench-e2e", "--model", str(broken), "--quant", "none", *SMALL, "--kl-tokens", "0"]
    assert duet_main(argv) == 1
    out = capsys.readouterr().out
    assert "quant" in out.splitlines()[1] and "TTFT ms" in out
    assert out.splitlines()[-1].startswith("none: error: ")


def test_bad_arguments_are_refused(tiny_dir, capsys):
    cases = {"--quant": ["int3"], "--prompt-len": ["600"], "--batch": ["0"]}
    for flag, value in cases.items():
        p, args = parse_args(["--model", str(tiny_dir), "--prompt-len", "100", flag, *value])
        with pytest.raises(SystemExit):
            check_args(p, args)
        assert flag in capsys.readouterr().err.splitlines()[-1]
    p, args = parse_args(["--model", str(tiny_dir), "--prompt-len", "100", "--quant", "int8"])
    assert check_args(p, args) == ["none", "int8"]  # the reference is added
    # every scheme of the config (control.quant_schemes), and its +head / @pack rows
    assert set(QUANT_SCHEMES) <= set(ROWS) and {"int4+head", "int4@pack"} <= set(ROWS)
    assert {"int4/int4", "int4/none+head", "none/int8@pack", "int4/int4+head@pack"} <= set(ROWS)
    assert not {"int4/int2", "int4+head/int4", "int4/"} & set(ROWS)
    argv = ["--model", str(tiny_dir), "--prompt-len", "100", "--quant", "int8,int4,int4+head"]
    p, args = parse_args(argv)
    assert check_args(p, args) == ["none", "int8", "int4", "int4+head"]


def test_interleaved_rounds_give_medians_and_per_round_ratios():
    """The timing phase's rounds: TTFT / TPOT are the medians, the ratios the medians of each
    round's own ratio (round 2 ran while DRAM was slow for both: its ratio is still 2)."""
    rows = [{"quant": "none"}, {"quant": "int8"}, {"quant": "fp8", "error": "x"}]
    timing = {
        "none": {"ttft_s": [1.0, 3.0, 1.2], "tpot_s": [0.10, 0.30, 0.12]},
        "int8": {"ttft_s": [0.5, 1.5, 0.7], "tpot_s": [0.06, 0.15, 0.06]},
    }
    apply_interleaved(rows, timing)
    none, int8, fp8 = rows
    assert none["ttft_s"] == 1.2 and int8["ttft_s"] == 0.7 and int8["tpot_s"] == 0.06
    assert int8["prefill_speedup"] == pytest.approx(2.0)  # rounds: 2, 2, 1.71
    assert int8["tpot_ratio"] == pytest.approx(0.5)  # rounds: 0.6, 0.5, 0.5
    assert none["prefill_speedup"] == pytest.approx(1.0) and int8["rounds"] == 3
    assert "ttft_s" not in fp8


def test_a_head_row_holds_the_int8_head(tiny_dir, capsys):
    """`none+head`: the bf16 model with its LM head in int8. Its weights are the bf16 row's less
    the head's bf16 bytes plus its int8 ones and their scales; its outputs differ a little."""
    rc = duet_main(
        ["bench-e2e", "--model", str(tiny_dir), "--quant", "none,none+head", "--json"] + SMALL
    )
    assert rc == 0
    ref, head = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert head["quant"] == "none+head" and "error" not in head
    cfg = json.loads((tiny_dir / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    assert head["weights_bytes"] < ref["weights_bytes"]
    assert head["kl"] > 0 and head["top1_agreement"] > 0.5
    # the packed head: int8 rows plus an fp32 scale and an int32 sum per row, vs bf16 rows
    saved = ref["weights_bytes"] - head["weights_bytes"]
    assert saved == pytest.approx(vocab * hidden * 2 - (vocab * hidden + 8 * vocab), rel=0.05)


def test_bench_e2e_reports_bf16_int8_and_int4_in_one_run(tiny_dir, capsys):
    """none, int8 and int4 in one run, timed in the same interleaved rounds: the int4 row holds
    what an int4 load holds (MLPs and experts in 4 bits, attention in int8): fewer bytes than
    int8's, and a larger KL against bf16 than int8's (4 bits are coarser than 8)."""
    rc = duet_main(
        ["bench-e2e", "--model", str(tiny_dir), "--quant", "none,int8,int4", "--json"] + SMALL
    )
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["quant"] for r in rows] == ["none", "int8", "int4"]
    none, int8, int4 = rows
    for r in rows:
        assert "error" not in r and r["rounds"] == 1  # the interleaved timing ran every row
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0 and r["tpot_ratio"] > 0
    assert int4["weights_bytes"] == held_tensor_bytes(load_model(str(tiny_dir), "int4"))
    assert none["weights_bytes"] > int8["weights_bytes"] > int4["weights_bytes"]
    assert int4["weights_ratio"] == int4["weights_bytes"] / none["weights_bytes"]
    assert math.isfinite(int4["kl"]) and int4["kl"] > int8["kl"] > 0
    assert 0 < int4["top1_agreement"] <= 1


@pytest.mark.parametrize(
    ("row", "quant", "attention", "head"),
    [
        ("int4", "int4", "int8", "none"),
        ("int4/none", "int4", "none", "none"),
        ("int4/int4+head", "int4", "int4", "int8"),
        ("none/int8", "none", "int8", "none"),
    ],
)
def test_rows_load_the_schemes_they_name(tiny_dir, row, quant, attention, head):
    model = load_model(str(tiny_dir), row)
    assert (model.quant, model.attention_quant, model.lm_head_quant) == (quant, attention, head)
