"""A random-weight checkpoint of realistic size for serving benchmarks: `duet make-bench-model`.

`make_bench_model` writes a deepseek_v3 model directory whose every layer has the shapes of
DeepSeek-V2-Lite (hidden 2048, 16 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
qk_rope 64, v_head 128; 64 routed experts top-6 plus 2 shared, moe_intermediate 1408; the first
layer dense with intermediate 10944), V3-style routing (sigmoid scores, noaux_tc with the
correction bias, 8 groups top-4) and a vocabulary of 32000. Four layers (the default) are about
2.0 B parameters, 3.9 GB in bf16; one layer (dense only) is 0.21 B, 0.43 GB; 27 layers (V2-Lite's
depth) are 15.5 B, 30.9 GB.

`fp8=True` (`--fp8`) stores it DeepSeek-V3 style: every matrix a quantization scheme quantizes
(`control.quant_schemes.is_quantized`: the MLA projections but kv_b_proj, every MLP and expert
gate/up/down projection) as float8_e4m3fn `NAME` plus float32 `NAME_scale_inv` per 128x128 block,
with the matching `quantization_config`; the rest as in bf16. It is the same model (the same
draws, quantized from the bf16 tensors) in about half the disk: 2.1 GB for four layers, 15.7 GB
for 27.

The tokenizer is the tiny model's byte-level BPE trained on its built-in corpus with a target of
32000 ids; that corpus yields only ~1.5 k ids, so `vocab_size` in config.json is padded to 32000
(as real checkpoints pad their embeddings). Head rows of ids that decode to no text or to part
of a character (padding, special tokens, single UTF-8 bytes) are scaled down, so greedy decoding
picks whole-character tokens only and every token streams as text.

Memory stays bounded: tensors are drawn one at a time (seeded, in checkpoint order) and each shard
of at most `max_shard_bytes` (512 MiB, counted in stored bytes) is written and freed before the
next one is drawn. The peak (a shard, its serialized copy, torch itself) does not grow with depth
and is the same with fp8: measured 1.54 GB peak RSS for 2 bf16 layers, 1.60 GB for 3 fp8 layers,
so `--layers 27 --fp8` fits a small machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from control.model_config import ModelConfig
from control.quant_schemes import is_quantized, quantized_bytes
from model.checkpoint_reader import INDEX_FILE, SCALE_SUFFIX
from model.fp8_blocks import quantize_fp8_blockwise
from model.weight_names import checkpoint_shapes, keeps_fp32, mtp_shapes
from tinymodel.builder import BOS, EOS, FP8_BLOCK, _tokenizer_config, train_tokenizer

BENCH_VOCAB = 32000
VERSION_FILE = "duet_bench_model.json"
DEFAULT_SHARD_BYTES = 512 << 20


def bench_config(num_layers: int, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json: DeepSeek-V2-Lite layer shapes in a deepseek_v3 model (original key style)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": num_layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        # DeepSeek-V2-Lite's context: YaRN x40 over 4096 positions.
        "max_position_embeddings": 163840,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def _draw(
    name: str, shape: tuple[int, ...], gen: torch.Generator, clean_ids: torch.Tensor
) -> torch.Tensor:
    """One float32 tensor. Matrices get std 1/sqrt(fan_in), so activations keep unit scale
    through every layer and a bf16 forward pass neither overflows nor collapses."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return noise.mul_(0.05).clamp_(-0.1, 0.1).add_(1.0)
    if name.endswith("e_score_correction_bias"):
        return noise.mul_(0.05)
    if name == "model.embed_tokens.weight":
        return noise
    noise.mul_(shape[-1] ** -0.5)
    if name == "lm_head.weight":
        # Rows of log-normal norms give clear greedy winners (as in the tiny model).
        noise.mul_(torch.exp(0.4 * torch.randn(shape[0], 1, generator=gen)))
        # Other ids (padding, special, partial UTF-8 bytes) get logits near 0, far below the
        # best clean id's: greedy output is then whole characters, so every token streams as
        # a non-empty text chunk at once (a byte token would be held back until its character
        # is complete, bunching chunks and skewing inter-token latencies).
        noise[~clean_ids] *= 1e-3  # (a masked index is a copy: mul_ on it would be lost)
    return noise


def clean_token_mask(tok, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: ids that decode alone to non-empty text of whole characters."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=True)
        mask[i] = bool(text) and "\ufffd" not in text
    return mask


def fp8_config() -> dict[str, Any]:
    """config.json's `quantization_config` of an FP8 checkpoint (as the tiny model writes it)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }


def _stored_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes tensor `name` takes in the checkpoint: with `fp8`, a quantized matrix is 1 byte a
    weight plus its float32 `_scale_inv` per block; router tensors are float32."""
    if fp8 and is_quantized(name):
        return quantized_bytes("fp8", shape)
    return math.prod(shape) * (4 if keeps_fp32(name) else dtype.itemsize)


def _plan_shards(
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    max_shard_bytes: int,
    fp8: bool = False,
) -> list[list[str]]:
    """Tensor names per shard: greedy in checkpoint order, a shard closes before it would pass
    `max_shard_bytes` of stored bytes (a larger tensor gets a shard of its own; a quantized
    matrix's scales go with it)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _stored_bytes(name, shape, dtype, fp8)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def make_bench_model(
    out: str | Path,
    layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    mtp: bool = False,
    fp8: bool = False,
) -> Path:
    """Write the bench model to `out` (created if needed) and return its path.

    Args:
        layers: decoder layers; layer 0 is dense, the others MoE. Must be >= 1.
        seed: the weights are a function of (seed, layers); the tokenizer is always the same.
        dtype: dtype of the stored tensors (the router gate and bias stay float32).
        max_shard_bytes: the largest shard. Peak host memory is about twice that (safetensors
            serializes a shard in memory before writing it) plus torch itself.
        progress: a tqdm bar (bytes written) on stderr.
        mtp: add a DeepSeek-V3 MTP layer (an MoE layer plus its norms and projection; random,
            so its drafts are almost never accepted: `bench.decode_step --accept` forces them).
        fp8: store the matrices `control.quant_schemes.is_quantized` names as float8_e4m3fn plus
            `_scale_inv` (128x128 blocks), quantized from the `dtype` tensors of the same seed,
            and add the matching `quantization_config`.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(BENCH_VOCAB)
    vocab = max(BENCH_VOCAB, tok.get_vocab_size(with_added_tokens=True))
    clean_ids = clean_token_mask(tok, vocab)
    raw = bench_config(layers, vocab, tok.token_to_id(BOS), tok.token_to_id(EOS))
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    if mtp:
        raw["num_nextn_predict_layers"] = 1
    if fp8:
        raw["quantization_config"] = fp8_config()
    cfg = ModelConfig.from_dict(raw)
    shapes = checkpoint_shapes(cfg)
    if mtp:  # (without V3's copies of the embedding and head: the layer shares the main ones)
        shapes.update(mtp_shapes(cfg))

    plan = _plan_shards(shapes, dtype, max_shard_bytes, fp8)
    total = sum(_stored_bytes(n, s, dtype, fp8) for n, s in shapes.items())
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    kind = "fp8" if fp8 else raw["torch_dtype"]
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"writing {out.name} ({kind})",
        disable=not progress,
    )
    with bar:
        for i, names in enumerate(plan, start=1):
            file_name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            shard: dict[str, torch.Tensor] = {}
            for name in names:
                # The same draws whatever `fp8`: an fp8 model is its bf16 twin quantized.
                t = _draw(name, shapes[name], gen, clean_ids)
                t = t if keeps_fp32(name) else t.to(dtype)
                if fp8 and is_quantized(name):
                    shard[name], shard[name + SCALE_SUFFIX] = quantize_fp8_blockwise(t, FP8_BLOCK)
                else:
                    shard[name] = t
                del t
                bar.update(_stored_bytes(name, shapes[name], dtype, fp8))
            save_file(shard, str(out / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
            del shard  # free this shard before drawing the next one

    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / INDEX_FILE, index)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {**_tokenizer_config(), "model_max_length": raw["max_position_embeddings"]}
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]},
    )
    _write_json(out / "config.json", raw)
    num_params = sum(math.prod(s) for s in shapes.values())
    info = {"layers": layers, "seed": seed, "dtype": raw["torch_dtype"], "fp8": fp8}
    _write_json(out / VERSION_FILE, {**info, "num_params": num_params})
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`duet make-bench-model OUT [--layers N] [--seed S] [--dtype bfloat16|float32] [--mtp]
    [--fp8]`."""
    import argparse

    p = argparse.ArgumentParser(prog="duet make-bench-model", description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4: ~2 B params)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--mtp", action="store_true", help="add an MTP layer (random weights)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="DeepSeek-V3-style FP8 block weights (float8_e4m3fn + 128x128 scales): the same "
        "model in about half the disk",
    )
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be >= 1")
    dtype = getattr(torch, args.dtype)
    print(make_bench_model(args.out, args.layers, args.seed, dtype, mtp=args.mtp, fp8=args.fp8))
    return 0
