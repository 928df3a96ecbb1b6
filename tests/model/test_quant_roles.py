"""Per-role quantization: the cluster TOML's `quant` (and `quant_attention`) on each node, `duet
generate --quant / --prefill-quant / --decode-quant`, `duet up --prefill-quant / --decode-quant /
--quant-attention`, what a node loads, and the one-line errors that name the node and the key."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import fp8_checkpoint_with_blocks

from control.cluster_config import ClusterConfig
from control.errors import ConfigError
from control.sampling_params import SamplingParams
from deploy.local_cluster import parse_args, resolve_config
from model.deepseek import DeepseekModel
from model.quant import QuantizationError
from runtime.generate import OfflineGenerator
from runtime.node_process import load_model
from tinymodel.make import ensure_tiny_model, make_tiny_model

PROMPT_IDS = [5, 17, 40, 3, 99, 12, 7]


def _cluster(prefill=None, decode=None, dtype="bfloat16", model="") -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "model": model,
            "dtype": dtype,
            "prefill": [{"name": "p0", **(prefill or {})}],
            "decode": [{"name": "d0", **(decode or {})}],
        }
    )


def test_each_node_has_its_own_quant():
    cfg = _cluster(decode={"quant": "int8"})
    assert cfg.prefill[0].quant == "none" and cfg.decode[0].quant == "int8"
    assert _cluster(prefill={"quant": "fp8"}).prefill[0].quant == "fp8"


def test_misspelled_quant_names_the_node_and_the_key():
    with pytest.raises(
        ConfigError, match=r"node d0: quant must be one of none, int8, fp8, int4, got 'in8'"
    ):
        _cluster(decode={"quant": "in8"})
    with pytest.raises(ConfigError, match=r"\[prefill.p0\] quant must be str"):
        _cluster(prefill={"quant": 8})
    with pytest.raises(ConfigError, match=r'node p0: quant = "int8" needs dtype = "bfloat16"'):
        _cluster(prefill={"quant": "int8"}, dtype="float32")


def test_up_overrides_every_node_of_a_role():
    args = parse_args(  # `duet up`'s own parser: every option it has, at its default
        ["--prefill", "2", "--decode", "1", "--port", "8123", "--threads", "1"]
        + ["--model", str(ensure_tiny_model()), "--decode-quant", "fp8"]
    )
    raw = resolve_config(args)
    assert [n.get("quant", "none") for n in raw["prefill"]] == ["none", "none"]
    assert [n["quant"] for n in raw["decode"]] == ["fp8"]
    cfg = ClusterConfig.from_dict(raw)
    assert cfg.decode[0].quant == "fp8" and not cfg.uses_mtp
    args.mtp_tokens = 3  # `duet up --mtp-tokens 3`: every decode node speculates
    cfg = ClusterConfig.from_dict(resolve_config(args))
    assert cfg.uses_mtp and [(n.mtp, n.mtp_tokens) for n in cfg.decode] == [(True, 3)]
    assert cfg.router.reasoning_parser == ""
    args.reasoning_parser = "deepseek_r1"  # `duet up --reasoning-parser deepseek_r1`
    assert ClusterConfig.from_dict(resolve_config(args)).router.reasoning_parser == "deepseek_r1"
    args.tool_parser = "hermes"  # `duet up --tool-parser hermes`
    assert ClusterConfig.from_dict(resolve_config(args)).router.tool_parser == "hermes"
    assert ClusterConfig.from_dict(resolve_config(args)).security.kv_security == "curve"
    args.kv_security = "aead"  # `duet up --kv-security aead`
    assert ClusterConfig.from_dict(resolve_config(args)).security.kv_security == "aead"


def test_the_node_loader_and_duet_up_pass_the_key(monkeypatch):
    """A node's `quant_attention` reaches the loader (unset as None: `quant`'s default), and
    `duet up --quant-attention` sets it on every node of the config."""
    from model import pack_cache
    from native import ops
    from runtime import node_process

    seen = {}
    no_mtp = SimpleNamespace(mtp=None)  # what the loader goes on to ask of the model
    monkeypatch.setattr(pack_cache, "load_model", lambda *a, **kw: seen.update(kw) or no_mtp)
    monkeypatch.setattr(ops, "set_num_threads", lambda n: None)  # the loader sets the node's
    cluster = ClusterConfig.from_dict(
        {
            "model": "/m",
            "prefill": [{"name": "p", "quant": "int4"}],
            "decode": [{"name": "d", "quant": "int4", "quant_attention": "none"}],
        }
    )
    node_process.load_model(cluster, cluster.node("d"), None)
    assert (seen["quant"], seen["quant_attention"]) == ("int4", "none")
    node_process.load_model(cluster, cluster.node("p"), None)
    assert (seen["quant"], seen["quant_attention"]) == ("int4", None)

    raw = resolve_config(parse_args(["--prefill", "2", "--quant-attention", "int4"]))
    assert [n["quant_attention"] for n in (*raw["prefill"], *raw["decode"])] == ["int4"] * 3
    raw = resolve_config(parse_args([]))
    assert not any("quant_attention" in n for n in (*raw["prefill"], *raw["decode"]))


def test_a_node_loads_its_scheme():
    cfg = _cluster(decode={"quant": "int8"})
    assert load_model(cfg, cfg.decode[0], None).quant == "int8"
    assert load_model(cfg, cfg.prefill[0], None).quant == "none"


def _fp8_64_blocks(tmp_path) -> str:
    return str(fp8_checkpoint_with_blocks(tmp_path / "fp8-64", (64, 64)))


def test_a_node_that_cannot_run_its_scheme_says_which_node_and_key(tmp_path):
    model_dir = _fp8_64_blocks(tmp_path)
    cfg = _cluster(decode={"quant": "fp8"}, model=model_dir)
    with pytest.raises(QuantizationError) as err:
        load_model(cfg, cfg.decode[0], None)
    message = str(err.value)
    assert message.startswith('node d0: quant = "fp8": ') and "\n" not in message
    assert "[64, 64]" in message
    assert load_model(cfg, cfg.prefill[0], None).quant == "none"  # dequantized at load


def test_fp8_attention_that_cannot_run_says_which_node_and_key(tmp_path):
    """`quant_attention = "fp8"` on a checkpoint of 64x64 FP8 blocks is refused naming that key
    (its MLPs' `quant = "int4"` would load it)."""
    model_dir = _fp8_64_blocks(tmp_path)
    cfg = _cluster(decode={"quant": "int4", "quant_attention": "fp8"}, model=model_dir)
    with pytest.raises(QuantizationError) as err:
        load_model(cfg, cfg.decode[0], None)
    message = str(err.value)
    assert message.startswith('node d0: quant_attention = "fp8": ') and "\n" not in message
    assert "[64, 64]" in message and 'Use quant_attention = "int8" or "none"' in message
    cfg = _cluster(decode={"quant": "int4", "quant_attention": "none"}, model=model_dir)
    assert load_model(cfg, cfg.decode[0], None).attention_quant == "none"


def _duet(*args):
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def test_generate_per_role_quant_is_prefill_then_decode_models():
    """`duet generate --prefill-quant none --decode-quant int8`: the first token from the bf16
    model's prefill, the rest from int8 decode steps over the same KV: the offline twin of a
    bf16 prefill node feeding an int8 decode node."""
    model_dir = ensure_tiny_model()
    r = _duet(
        "generate",
        "--json",
        "--prompt-ids",
        ",".join(map(str, PROMPT_IDS)),
        "--max-new-tokens",
        "12",
        "--prefill-quant",
        "none",
        "--decode-quant",
        "int8",
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    bf16 = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False)
    int8 = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False, quant="int8")
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    want = OfflineGenerator(bf16, decode_model=int8).generate(PROMPT_IDS, greedy).token_ids
    assert got == want
    # --quant sets both; a role's own flag overrides it.
    r = _duet(
        "generate",
        "--json",
        "--prompt-ids",
        ",".join(map(str, PROMPT_IDS)),
        "--max-new-tokens",
        "12",
        "--quant",
        "int8",
        "--prefill-quant",
        "none",
    )
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == want


def test_generate_bad_quant_is_one_line(tmp_path):
    r = _duet("generate", "--prompt", "hi", "--quant", "int3")
    assert r.returncode == 2 and "invalid choice: 'int3'" in r.stderr
    assert "Traceback" not in r.stderr
    r = _duet("generate", "--model", _fp8_64_blocks(tmp_path), "--prompt", "hi", "--quant", "fp8")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith('error: quant = "fp8": ') and "[64, 64]" in lines[0]


def test_decode_model_must_be_the_same_checkpoint(tmp_path):
    from control.errors import InvalidRequestError

    other = make_tiny_model(tmp_path / "other", overrides={"num_hidden_layers": 2})
    a = DeepseekModel.from_pretrained(ensure_tiny_model(), torch.bfloat16, progress=False)
    b = DeepseekModel.from_pretrained(other, torch.bfloat16, progress=False)
    with pytest.raises(InvalidRequestError, match="prefill model's checkpoint"):
        OfflineGenerator(a, decode_model=b)
