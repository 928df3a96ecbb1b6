"""`duet bench-masks` runs (masks only, a few steps) for a JSON schema and for a forced tool
call of each parser, and reports every phase for every batch (the figures are the bench's, not
checked here)."""

import json

import pytest

from bench import structured_masks


@pytest.mark.parametrize("extra", [[], ["--tool-call", "hermes"], ["--tool-call", "deepseek_v3"]])
def test_bench_masks_reports_each_batch(capsys, extra):
    args = ["--masks-only", "--batch", "1", "3", "--steps", "3", "--json", *extra]
    assert structured_masks.main(args) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        assert all(r[k] >= 0 for k in ("fill_ms", "bias_ms", "apply_ms", "mask_ms_per_row"))


def test_a_synthetic_vocabulary_has_exactly_the_size_asked(tmp_path, tiny_dir):
    """The tokenizer `--vocab N` builds: N tokens, in the tokenizer and in the config the masks
    read, with EOS where the config says."""
    from pathlib import Path

    from bench.synthetic_vocab import synthetic_vocab_model
    from control.model_config import ModelConfig
    from control.tokenizer import Tokenizer

    out = synthetic_vocab_model(6000, tmp_path / "m", Path(tiny_dir), num_lines=4000)
    tok = Tokenizer(str(out))
    assert tok.vocab_size == 6000
    cfg = ModelConfig.from_model_dir(str(out))
    assert cfg.vocab_size == 6000 and tok.eos_token_ids[0] in cfg.eos_token_id


def test_vocab_needs_masks_only():
    with pytest.raises(SystemExit, match="--vocab needs --masks-only"):
        structured_masks.main(["--vocab", "5000", "--batch", "1", "--steps", "1"])
