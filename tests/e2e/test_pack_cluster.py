"""End to end through packed weights: `duet up` with int8 on both roles builds the checkpoint's
pack once under the cache (the two nodes wait on one build) and both map it; served to the
official openai client, outputs equal `duet generate --quant int8`. SIGKILLed, the supervised
decode node comes back mapping the same pack (no second build) and the cluster serves again;
/v1/cluster and /metrics say where each node's weights live."""

import os
import re
import signal

import httpx
import pytest
from e2e_helpers import generate_reference, start_cluster, wait_until

from tinymodel.make import make_tiny_model

PROMPT = "The quick brown fox"
MAX_NEW = 12


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    model = make_tiny_model(root / "packed-model", seed=4)
    cache = root / "cache"
    args = ["--model", str(model), "--threads", "1", "--prefill-quant", "int8",
            "--decode-quant", "int8"]  # fmt: skip
    up = start_cluster(args, tmp_path_factory, env={"DUET_CACHE_DIR": str(cache)})
    yield up, model, cache / "packs"
    up.stop()


def _served(up, model) -> str:
    out = up.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0
    )
    return out.choices[0].text


def test_both_nodes_map_one_pack_built_once(packed):
    up, model, packs = packed
    [pack] = [p for p in packs.iterdir() if p.suffix == ".pack"]
    log = up.log()
    assert len(re.findall(r"INFO building .*\.pack from", log)) == 1, log[-3000:]
    for node in ("prefill-0", "decode-0"):
        assert re.search(rf"{node} INFO weights: pack {re.escape(str(pack))} .*file mapping", log)
    want = generate_reference(
        "bfloat16", MAX_NEW, prompt=PROMPT, model=str(model), extra=("--quant", "int8")
    )
    assert _served(up, model) == want["text"]
    nodes = httpx.get(up.url + "/v1/cluster", timeout=10).json()["nodes"]
    assert all(n["weights"].startswith(f"pack {pack}") for n in nodes)
    backing = [
        up.metric("duet_node_weights_backing_info", backing=b, node=n, role=r)
        for n, r in (("prefill-0", "prefill"), ("decode-0", "decode"))
        for b in ("file", "file_hugepages")
    ]
    assert sum(backing) == 2


def test_a_killed_decode_node_comes_back_mapping_the_pack(packed):
    up, model, _ = packed
    want = _served(up, model)
    victim = up.child_pids["decode-0"]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: "decode-0 exited with status -9; restarting" in up.log(), 30)
    assert wait_until(lambda: len(re.findall(r"decode-0 INFO weights: pack", up.log())) == 2, 120)
    assert len(re.findall(r"INFO building .*\.pack from", up.log())) == 1  # mapped, not rebuilt

    def serves():
        try:
            return _served(up, model) == want
        except Exception:  # the router may still refuse while the node rejoins
            return False

    assert wait_until(serves, 60)
