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
