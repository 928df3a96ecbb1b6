"""The packed weight store: shards, refusals, the cache, page sharing between processes, and the
NUMA-local copy. The oracle of every model comparison is the same model packed in the heap
(`DeepseekModel.from_pretrained`)."""

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading
import zlib

import pytest
import torch

from control.placement import plan_rank
from model import pack_cache
from model.deepseek import DeepseekModel
from model.pack_cache import build_pack, ensure_cached_pack, load_model, local_copy, pack_spec
from model.weight_pack import LAYOUT_VERSION, MappedPack, PackError, PackSpec, PackWriter
from native import ops
from runtime.generate import OfflineGenerator
from tinymodel.make import make_tiny_model

needs_native = pytest.mark.skipif(not ops.native_available(), reason="packing needs the kernels")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The random tiny model with an MTP layer, in shards (a pack reads across files)."""
    overrides = {"num_nextn_predict_layers": 1}
    return make_tiny_model(tmp_path_factory.mktemp("m"), 2, overrides, max_shard_bytes=1 << 20)


@pytest.fixture(scope="module")
def int8_pack(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "int8.pack"
    build_pack(model_dir, path, pack_spec(model_dir, torch.bfloat16, "int8"), progress=False)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "packs"


def _greedy(model, n=8):
    gen = OfflineGenerator(model, page_size=4, chunk_size=8)
    table = gen.pool.new_table()
    rows = [gen.prefill(table, list(range(5, 26)))]
    for i in range(n):
        rows.append(gen.decode(table, int(rows[-1].argmax()), 21 + i))
    gen.pool.release(table)
    return torch.stack(rows)


# ---- shards and layouts ----------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize(
    "shard",
    [
        {"expert_range": range(2, 5)},  # an expert-parallel rank's, out of the whole pack
        {"tensor_parallel": (1, 2), "parallel": "tp"},
        {"tensor_parallel": (0, 2), "parallel": "tp_sp"},
    ],
    ids=["ep", "tp", "tp_sp"],
)
def test_a_shard_maps_to_the_same_shard_model(model_dir, tmp_path, shard):
    kwargs = dict(quant="int8", progress=False, **shard)
    heap = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, **kwargs)
    spec = pack_spec(
        model_dir,
        torch.bfloat16,
        "int8",
        shard.get("expert_range"),
        shard.get("tensor_parallel"),
        shard.get("parallel", "tp"),
    )
    build_pack(model_dir, tmp_path / "s.pack", spec, progress=False)
    mapped = load_model(model_dir, torch.bfloat16, pack=tmp_path / "s.pack", **kwargs)
    assert mapped.expert_range == heap.expert_range
    # one rank's partial model (no collectives): its own computation, identical either way
    if "tensor_parallel" not in shard:
        assert torch.equal(_greedy(heap), _greedy(mapped))
    heap_w = heap.layers[1].mlp.experts.w13
    mapped_w = mapped.layers[1].mlp.experts.w13
    assert torch.equal(heap_w.packed, mapped_w.packed) and torch.equal(heap_w.scale, mapped_w.scale)
    heap_q = heap.layers[0].attn.q_b_proj.weight
    assert torch.equal(heap_q.packed, mapped.layers[0].attn.q_b_proj.weight.packed)


def test_reference_layout_round_trip_in_fp32(model_dir, tmp_path):
    """Native kernels off: the reference twins' forms (raw tensors, Int8Weight tuples) pack too."""
    ops.set_native_enabled(False)
    try:
        spec = pack_spec(model_dir, torch.float32, "none", mtp=True)
        assert spec.layout == "reference"
        build_pack(model_dir, tmp_path / "r.pack", spec, progress=False)
        heap = DeepseekModel.from_pretrained(model_dir, torch.float32, progress=False, mtp=True)
        mapped = load_model(model_dir, torch.float32, mtp=True, pack=tmp_path / "r.pack")
        assert torch.equal(_greedy(heap, 3), _greedy(mapped, 3))
        assert mapped.mtp is not None
    finally:
        ops.set_native_enabled(True)


@needs_native
def test_a_native_pack_is_refused_by_a_reference_process(model_dir, int8_pack):
    ops.set_native_enabled(False)
    try:
        with pytest.raises(PackError, match="layout is 'native', this process needs 'reference'"):
            load_model(model_dir, torch.bfloat16, "int8", pack=int8_pack)
    finally:
        ops.set_native_enabled(True)


# ---- never a wrong pack ----------------------------------------------------------------------
def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def _rewrite_manifest(path, edit):
    """The pack with its manifest edited and the footer fixed (crc too): a valid file of
    another spec."""
    raw = path.read_bytes()
    offset, length, _crc, magic = struct.unpack("<QQQ8s", raw[-32:])
    manifest = json.loads(raw[offset : offset + length])
    edit(manifest)
    body = json.dumps(manifest).encode()
    path.write_bytes(
        raw[:offset] + body + struct.pack("<QQQ8s", offset, len(body), zlib.crc32(body), magic)
    )


@needs_native
def test_every_bad_pack_is_refused_with_its_file_and_reason(model_dir, int8_pack, tmp_path):
    def refused(path, match, quant="int8", **kwargs):
        with pytest.raises(PackError, match=match) as err:
            load_model(model_dir, torch.bfloat16, quant, pack=path, **kwargs)
        assert str(path) in str(err.value) and "\n" not in str(err.value)

    truncated = tmp_path / "truncated.pack"
    truncated.write_bytes(int8_pack.read_bytes()[: int8_pack.stat().st_size // 2])
    refused(truncated, "not a duet-serve pack|truncated")
    cut_tail = tmp_path / "cut.pack"
    cut_tail.write_bytes(int8_pack.read_bytes()[:-1])
    refused(cut_tail, "not a duet-serve pack")
    refused(tmp_path / "missing.pack", "cannot read it")
    (tmp_path / "tiny.pack").write_bytes(b"DUET")
    refused(tmp_path / "tiny.pack", "truncated")

    corrupt = _copy(int8_pack, tmp_path / "corrupt.pack")
    with open(corrupt, "r+b") as f:
        f.seek(4096 + 17)
        byte = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([byte[0] ^ 0x10]))
    refused(corrupt, "corrupt \\(checksum mismatch")

    bad_manifest = _copy(int8_pack, tmp_path / "manifest.pack")
    with open(bad_manifest, "r+b") as f:
        f.seek(bad_manifest.stat().st_size - 40)
        f.write(b"#")
    refused(bad_manifest, "corrupt manifest")

    stale = _copy(int8_pack, tmp_path / "stale.pack")
    _rewrite_manifest(stale, lambda m: m["spec"].update(layout_version=LAYOUT_VERSION - 1))
    refused(stale, "stale layout version")

    other = _copy(int8_pack, tmp_path / "other.pack")
    _rewrite_manifest(other, lambda m: m["spec"].update(fingerprint="0" * 64))
    refused(other, "fingerprint is '0000")
    refused(int8_pack, "quant is 'int8', this process needs 'fp8'", quant="fp8")
    refused(int8_pack, "tensor_parallel is None", tensor_parallel=(0, 2))
    refused(int8_pack, "mtp is False", mtp=True)
    wanted = PackSpec("f", "none", "float32")
    assert wanted.mismatch(PackSpec("f", "none", "bfloat16")) == (
        "dtype is 'bfloat16', this process needs 'float32'"
    )


def test_another_checkpoint_has_another_fingerprint(model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=3)  # same shapes, other values
    assert pack_cache.checkpoint_fingerprint(other) != pack_cache.checkpoint_fingerprint(model_dir)
    assert pack_cache.checkpoint_fingerprint(model_dir) == pack_cache.checkpoint_fingerprint(
        model_dir
    )


# ---- the cache -------------------------------------------------------------------------------
@needs_native
def test_the_cache_builds_once_for_concurrent_loaders(model_dir, cache, monkeypatch):
    builds = []
    real = pack_cache.build_pack

    def counting(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pack_cache, "build_pack", counting)
    spec = pack_spec(model_dir, torch.bfloat16, "int8")
    paths = []
    threads = [
        threading.Thread(target=lambda: paths.append(ensure_cached_pack(model_dir, spec, False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(paths) == 3 and len(set(paths)) == 1 and builds == [1]
    assert paths[0].parent == cache
    assert [p.name for p in cache.iterdir() if p.suffix == ".pack"] == [paths[0].name]
    # another scheme is another pack; the same one is mapped, not rebuilt
    ensure_cached_pack(model_dir, pack_spec(model_dir, torch.bfloat16, "fp8"), False)
    load_model(model_dir, torch.bfloat16, "int8", weights_cache=True)
    assert builds == [1, 1]


@needs_native
def test_a_corrupt_cached_pack_is_rebuilt(model_dir, cache, caplog):
    spec = pack_spec(model_dir, torch.bfloat16, "int8")
    path = ensure_cached_pack(model_dir, spec, False)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    with caplog.at_level(logging.WARNING, logger="duet.pack"):
        model = load_model(model_dir, torch.bfloat16, "int8", weights_cache=True)
    assert any(
        "checksum mismatch" in r.message and "rebuilding" in r.message for r in caplog.records
    )
    heap = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False, quant="int8")
    assert torch.equal(_greedy(heap, 2), _greedy(model, 2))


# ---- sharing and placement -------------------------------------------------------------------
_MAP_AND_REPORT = textwrap.dedent(
    """
    import sys, time
    from model.pack_cache import _smaps_fields
    from model.weight_pack import MappedPack
    pack = MappedPack(sys.argv[1])  # verifying reads every page
    print("mapped", flush=True)
    sys.stdin.readline()  # both have mapped: now each one's PSS is its share
    f = _smaps_fields(pack.address)
    print(f["Rss"], f["Pss"], flush=True)
    sys.stdin.readline()  # both have reported: exit
    """
)


def test_two_processes_mapping_one_pack_share_its_pages(tmp_path):
    path = tmp_path / "big.pack"
    writer = PackWriter(path, PackSpec("f", "none", "bfloat16"))
    writer.add("raw:w", torch.randn(8 << 20, dtype=torch.float32))  # 32 MiB
    writer.finish()
    kib = path.stat().st_size / 1024
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MAP_AND_REPORT, str(path)],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "mapped"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.stdout.readline().split() for p in procs]
    for p in procs:
        p.communicate("exit\n", timeout=60)
    rss, pss = [int(o[0]) for o in outs], [int(o[1]) for o in outs]
    assert all(r >= 0.95 * kib for r in rss)  # each sees the whole pack resident
    assert sum(pss) <= 1.05 * kib  # but the two hold one copy between them
    assert all(p <= 0.55 * kib for p in pss)


def test_a_rank_bound_to_its_numa_node_maps_that_nodes_copy(
    model_dir, int8_pack, tmp_path, monkeypatch
):
    """On a (fake) two-node host the placement binds rank 1 to node 1; its loader then maps a
    node-1 copy (written by that process, so its pages are that node's), made once."""
    monkeypatch.setenv("DUET_NUMA_COPY_DIR", str(tmp_path / "shm"))
    nodes = {0: [0, 1], 1: [2, 3]}
    placement = plan_rank(1, 2, [0, 1, 2, 3], nodes)
    assert placement.numa_node == 1
    copy = local_copy(int8_pack, placement.numa_node)
    assert copy == tmp_path / "shm" / "duet-packs" / f"{int8_pack.stem}.node1.pack"
    assert copy.read_bytes() == int8_pack.read_bytes()
    mtime = copy.stat().st_mtime_ns
    assert local_copy(int8_pack, 1) == copy and copy.stat().st_mtime_ns == mtime  # made once
    assert local_copy(int8_pack, None) == int8_pack  # unbound: the pack itself
    if ops.native_available():
        model = load_model(model_dir, torch.bfloat16, "int8", pack=int8_pack, numa_node=1)
        assert model.pack.path == copy


def test_a_huge_page_tmpfs_gets_the_copy(int8_pack, tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HUGEPAGE_DIR", str(tmp_path / "huge"))
    (tmp_path / "huge").mkdir()
    copy = local_copy(int8_pack, None)
    assert copy.parent == tmp_path / "huge" / "duet-packs" and copy.name.endswith(".huge.pack")
    assert MappedPack(copy).spec == MappedPack(int8_pack).spec
    monkeypatch.delenv("DUET_HUGEPAGE_DIR")
    plain = "tmpfs /dev/shm tmpfs rw,nosuid,size=24731408k 0 0\n/dev/vda / ext4 rw 0 0\n"
    huge = plain.replace("size=24731408k", "size=24731408k,huge=within_size")
    assert pack_cache.hugepage_dir(plain) is None
    assert pack_cache.hugepage_dir(huge) == pack_cache.Path("/dev/shm")


def test_the_husk_holds_no_weights(model_dir, tmp_path):
    """Building a pack keeps nothing: the model it builds on the way holds no packed weight."""
    writer = PackWriter(tmp_path / "h.pack", pack_spec(model_dir, torch.bfloat16, "int8"))
    with DeepseekModel.open_checkpoint(
        model_dir, torch.bfloat16, None, False, "int8", False, None, "tp"
    ) as (cfg, reader, experts):
        husk = DeepseekModel(cfg, reader, torch.bfloat16, experts, "int8", sink=writer)
    writer.finish()
    layer = husk.layers[1]
    assert layer.attn.q_b_proj.weight is None and layer.mlp.experts.w13 is None
    assert husk.lm_head.weight is None
    assert os.path.getsize(tmp_path / "h.pack") > 0


# ---- the attention projections' scheme -------------------------------------------------------
def test_the_attention_scheme_is_part_of_a_packs_spec_and_key(model_dir):
    """`quant`'s default attention scheme (int8 under int4) leaves the spec as it was before the
    key: no `attention` in the manifest, so the cache keys of packs made then hold, and a
    manifest without one reads as the default. Any other names it."""
    default = pack_spec(model_dir, torch.bfloat16, "int4")
    explicit = pack_spec(model_dir, torch.bfloat16, "int4", quant_attention="int8")
    dense = pack_spec(model_dir, torch.bfloat16, "int4", quant_attention="none")
    assert default == explicit and (default.attention, dense.attention) == ("int8", "none")
    assert "attention" not in default.to_json() and dense.to_json()["attention"] == "none"
    for spec in (default, dense):
        assert PackSpec.from_json(spec.to_json()) == spec
    assert PackSpec("f", "none", "bfloat16").attention == "none"
    assert PackSpec("f", "int4", "bfloat16").attention == "int8"
    assert dense.mismatch(default) == "attention is 'int8', this process needs 'none'"


@needs_native
def test_a_pack_of_one_attention_scheme_maps_only_as_it(model_dir, int8_pack, tmp_path, cache):
    """int4 MLPs with bf16 attention, and everything int4 (the MTP layer's eh_proj too): each
    pack maps to the heap model's logits exactly; a process of another attention scheme is
    refused in one line naming the file and the field; past the spec check (a manifest edited
    to the default's) the attention weights' keys differ, so none is read as another scheme's;
    the weights cache keeps a pack per attention scheme."""
    packs = {}
    for attention in ("none", "int4"):
        path = packs[attention] = tmp_path / f"{attention}.pack"
        spec = pack_spec(model_dir, torch.bfloat16, "int4", mtp=True, quant_attention=attention)
        build_pack(model_dir, path, spec, progress=False)
        kwargs = {"mtp": True, "quant_attention": attention}
        mapped = load_model(model_dir, torch.bfloat16, "int4", pack=path, **kwargs)
        heap = DeepseekModel.from_pretrained(
            model_dir, torch.bfloat16, progress=False, quant="int4", **kwargs
        )
        assert mapped.attention_quant == attention and mapped.weights_backing != "heap"
        assert torch.equal(_greedy(mapped), _greedy(heap))

    def refused(path, match, quant="int4", **kwargs):
        with pytest.raises(PackError, match=match) as err:
            load_model(model_dir, torch.bfloat16, quant, pack=path, **kwargs)
        assert str(path) in str(err.value) and "\n" not in str(err.value)

    refused(packs["none"], "attention is 'none', this process needs 'int8'", mtp=True)
    as_fp8 = {"mtp": True, "quant_attention": "fp8"}
    refused(packs["int4"], "attention is 'int4', this process needs 'fp8'", **as_fp8)
    refused(
        int8_pack, "attention is 'int8', this process needs 'none'", "int8", quant_attention="none"
    )
    edited = _copy(packs["int4"], tmp_path / "edited.pack")
    _rewrite_manifest(edited, lambda m: m["spec"].pop("attention"))
    refused(edited, "has no weight 'linear:model.layers.0.self_attn.q_a_proj.weight'", mtp=True)

    for attention in (None, "none"):
        load_model(model_dir, torch.bfloat16, "int4", weights_cache=True, quant_attention=attention)
    names = sorted(p.name for p in cache.glob("*.pack"))
    assert len(names) == 2 and sum("-int4-noneattn-" in n for n in names) == 1, names
