"""`duet generate` end to end as a user runs it: JSON output, and one-line errors (no traceback,
non-zero exit) for bad input."""

import json
import os
import subprocess
import sys

import pytest

from tinymodel.make import make_tiny_model


def duet(*args, env_extra=None, timeout=180):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", seed=0)


def assert_one_line_error(result, needle):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0]


def test_generate_json(model_dir):
    r = duet(
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "Hello world",
        "--max-new-tokens",
        "5",
        "--json",
        "--dtype",
        "float32",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert 1 <= len(out["token_ids"]) <= 5 and isinstance(out["text"], str)
    again = duet(
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "Hello world",
        "--max-new-tokens",
        "5",
        "--json",
        "--dtype",
        "float32",
    )
    assert json.loads(again.stdout.strip().splitlines()[-1]) == out  # greedy is deterministic


def test_empty_prompt(model_dir):
    assert_one_line_error(duet("generate", "--model", str(model_dir), "--prompt", ""), "empty")


def test_prompt_past_context(model_dir):
    ids = ",".join(["5"] * 600)
    r = duet("generate", "--model", str(model_dir), "--prompt-ids", ids)
    assert_one_line_error(r, "max_position_embeddings")


def _copy(model_dir, dst):
    dst.mkdir()
    for f in model_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_corrupt_safetensors(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x10\x00garbage" * 10)
    r = duet("generate", "--model", str(bad), "--prompt", "hi")
    assert_one_line_error(r, "model.safetensors")


def test_missing_tensor(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _copy(model_dir, tmp_path / "missing")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    r = duet("generate", "--model", str(bad), "--prompt", "hi")
    assert_one_line_error(r, "model.layers.1.self_attn.o_proj.weight")


def test_unknown_model_type(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path / "llama")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = duet("generate", "--model", str(bad), "--prompt", "hi")
    assert_one_line_error(r, "model_type")


def test_sampling_flags(model_dir):
    """The API's sampling parameters as flags (what the e2e tests compare the cluster with)."""
    base = ["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--json"]
    base += ["--max-new-tokens", "4", "--dtype", "float32"]
    r = duet(*base, "--logit-bias", '{"42": 100}', "--temperature", "1", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == [42] * 4
    flags = "--presence-penalty 0.5 --frequency-penalty 0.5 --repetition-penalty 1.2 --min-p 0.1"
    flags += " --min-tokens 4 --stop-token-ids 3,4 --ignore-eos"
    r = duet(*base, *flags.split())
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]) == 4  # min_tokens
    assert_one_line_error(duet(*base, "--presence-penalty", "3"), "presence_penalty must be in")
    assert_one_line_error(duet(*base, "--logit-bias", '{"9999": 1}'), "outside the vocabulary")
    r = duet(*base, "--logit-bias", "[1, 2]")
    assert r.returncode == 2 and "--logit-bias must be a JSON object" in r.stderr


def test_pack_then_generate_through_it(model_dir, tmp_path):
    """`duet pack` writes the int8 pack that `duet generate --pack` maps: the same greedy tokens
    as loading the checkpoint; a pack of another scheme is one line naming the file."""
    pack = tmp_path / "int8.pack"
    r = duet("pack", "--model", str(model_dir), "--quant", "int8", "--out", str(pack))
    assert r.returncode == 0, r.stderr
    assert "GB of pack" in r.stdout and pack.stat().st_size > 0
    common = ("generate", "--model", str(model_dir), "--prompt-ids", "5,9,14", "--json",
              "--max-new-tokens", "6", "--quant")  # fmt: skip
    mapped = duet(*common, "int8", "--pack", str(pack))
    heap = duet(*common, "int8")
    assert mapped.returncode == 0, mapped.stderr
    assert json.loads(mapped.stdout)["token_ids"] == json.loads(heap.stdout)["token_ids"]
    assert_one_line_error(duet(*common, "fp8", "--pack", str(pack)), str(pack))


def test_pack_and_generate_with_an_attention_scheme(model_dir, tmp_path):
    """`duet pack --quant int4 --quant-attention none` writes a pack of bf16 attention (its
    manifest says so) that `duet generate` with the same flags maps to the same greedy tokens as
    loading the checkpoint with them; without the flag (int8 attention) it is refused in one
    line naming the file and the field."""
    from model.weight_pack import read_manifest

    pack = tmp_path / "int4-none.pack"
    flags = ("--quant", "int4", "--quant-attention", "none")
    r = duet("pack", "--model", str(model_dir), *flags, "--out", str(pack))
    assert r.returncode == 0, r.stderr
    assert read_manifest(pack)["spec"]["attention"] == "none"
    common = ("generate", "--model", str(model_dir), "--prompt-ids", "5,9,14", "--json")
    common += ("--max-new-tokens", "6")
    mapped = duet(*common, *flags, "--pack", str(pack))
    heap = duet(*common, *flags)
    assert mapped.returncode == 0 and heap.returncode == 0, mapped.stderr + heap.stderr
    assert json.loads(mapped.stdout)["token_ids"] == json.loads(heap.stdout)["token_ids"]
    refused = duet(*common, "--quant", "int4", "--pack", str(pack))
    assert_one_line_error(refused, "attention is 'none', this process needs 'int8'")
    assert str(pack) in refused.stderr


def test_generate_with_mtp_is_lossless_whatever_the_draft_head(tmp_path):
    """`--mtp-draft-head` moves only how often drafts are accepted: greedy output is plain
    decoding's (no `--mtp-tokens`) under each head."""
    mtp_dir = make_tiny_model(tmp_path / "mtp", seed=11, overrides={"num_nextn_predict_layers": 1})
    common = ("generate", "--model", str(mtp_dir), "--prompt-ids", "1,5,9,30,2,7,8", "--json")
    common += ("--max-new-tokens", "12", "--ignore-eos", "--dtype", "float32")
    plain = duet(*common)
    assert plain.returncode == 0, plain.stderr
    for head in ("none", "int8", "int4"):
        r = duet(*common, "--mtp-tokens", "2", "--mtp-draft-head", head)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"], head
    bad = duet(*common, "--mtp-tokens", "2", "--mtp-draft-head", "fp8")
    assert bad.returncode != 0 and "invalid choice: 'fp8'" in bad.stderr
