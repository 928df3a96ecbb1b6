"""A tiny DeepSeek checkpoint, written on the spot: for tests, demos and benches.

`make_tiny_model` writes a complete Hugging Face model directory (config.json in the original
DeepSeek key style, safetensors weights, a byte-level BPE tokenizer trained here on a built-in
corpus, tokenizer_config.json with a chat template) that both this engine and `transformers`
load: random weights by default, or (`random=False`) weights trained on the Python standard
library with one MTP layer (`tinymodel.train_model`). Everything is seed-deterministic.
`ensure_tiny_model` keeps one trained copy in the user cache, keyed by what it was trained from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from control.model_config import ModelConfig
from model.fp8_blocks import quantize_fp8_blockwise
from model.weight_names import checkpoint_shapes, mtp_copy_names, mtp_shapes
from model.weights import save_checkpoint

# Bump when the generated files change, so a cached copy from an older version is rebuilt.
TINY_MODEL_VERSION = 3  # 3: the chat template renders tools
VERSION_FILE = "duet_tiny_model.json"
FP8_BLOCK = (128, 128)

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
TOKENIZER_VOCAB = 512

# Overrides that turn the tiny model into a DeepSeek-V2-Lite style one (q_lora_rank null,
# softmax greedy routing without renormalization, no rope scaling).
V2_LITE_OVERRIDES = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "q_lora_rank": None,
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "rope_scaling": None,
}

# Tools as Hermes-style templates have them: the functions' schemas in a system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (the `hermes` tool parser), results in
# <tool_response> on the user's side.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>You may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    '<tool_call>{"name": "{{ call["function"]["name"] }}", '
    '"arguments": {{ call["function"]["arguments"] }}}</tool_call>'
    "{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}"
    "<|user|><tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Training text for the tokenizer: plain English with digits, punctuation, code and some
# multi-byte characters (accents, CJK, emoji) so that tokens splitting a UTF-8 character occur.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat, and every evening he came back with fish for dinner.
She asked him: "Why do you go out so early?" He said, "Because the fish wake up before me."
Hello, world! How are you today? I am fine, thank you. And you?
The meeting is at 10:30 on Monday, 3 March 2025, in room 214. Please bring 2 copies.
Prices rose by 4.5% in 2023; the index went from 1,024 to 1,070 points (+46).
Call 555-0199 or write to info@example.com before 5 p.m. on Friday.
She ordered a café au lait and a croissant; he had a naïve idea about the résumé.
The piñata at the fiesta was filled with jalapeño candies. Ångström units are tiny.
Über cool: the Zürich crème brûlée cost 12 € and the façade was painted.
日本語のテキストも少し含まれています。東京は日本の首都です。
中文也可以：你好，世界！今天天气很好。
Emoji time: 😀 🎉 🚀 ❤️ 👍 — the rocket 🚀 goes up, the heart ❤️ stays.
Greek letters: α β γ δ λ π Σ Ω; math: x² + y² = z², ∑ i = n(n+1)/2, √2 ≈ 1.414.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

if (x > 0 && y < 100) { return x + y; } else { return -1; }
The model reads the prompt, computes the attention, and samples the next token.
Large language models predict text one token at a time, using what came before.
Disaggregated serving splits prefill and decode onto different machines.
The prefill node is compute bound; the decode node is memory bound.
Attention heads share a compressed latent cache; experts are routed per token.
A mixture of experts sends each token to a few experts chosen by a router.
Tokens flow through embedding, attention, feed forward layers, and the output head.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
January February March April May June July August September October November December.
One two three four five six seven eight nine ten eleven twelve twenty hundred thousand.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 128 256 512 1024 2048 4096.
Red, orange, yellow, green, blue, indigo and violet are the colors of the rainbow.
The cat sat on the mat. The dog sat on the log. The bird sang in the tree.
Water boils at 100 degrees Celsius and freezes at 0 degrees at sea level.
The train leaves at 7:45 and arrives at 9:15, stopping at three stations on the way.
Please summarize the following paragraph in one sentence, and keep it short.
Translate "good morning" into French: bonjour. Into Spanish: buenos días.
Question: what is the capital of France? Answer: Paris is the capital of France.
Question: what is 12 times 12? Answer: 144. Question: what is 7 plus 8? Answer: 15.
The library opens at nine, closes at six, and is closed on public holidays.
He read the book twice, wrote a long review, and recommended it to his friends.
It was the best of times, it was the worst of times, it was the age of wisdom.
To be, or not to be, that is the question; whether 'tis nobler in the mind to suffer.
All happy families are alike; each unhappy family is unhappy in its own way.
Science is a way of thinking much more than it is a body of knowledge.
Simple things should be simple, complex things should be possible.
Errors should never pass silently, unless explicitly silenced.
The weather today is sunny with a light breeze; tomorrow it may rain in the north.
Our team won the match 3-1 after a difficult first half; the crowd cheered loudly.
Mix the flour, sugar and eggs; bake for 25 minutes at 180 °C until golden brown.
The river flows north through the valley, past farms, forests and old stone bridges.
Children played in the park while their parents talked on the benches nearby.
Remember to save your work often, and keep a backup copy in a safe place.
"""


# ---- config -------------------------------------------------------------------------------------
def tiny_config(vocab_size: int, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the default tiny deepseek_v3 model (original DeepSeek key style)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---- weights ------------------------------------------------------------------------------------
def _std(name: str) -> float:
    """Init scale per tensor kind (norm weights and the router bias are handled separately)."""
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 0.5
    return 0.1


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seed-deterministic float32 weights for every tensor of `cfg`, in checkpoint order.

    Values are rounded to bf16-representable numbers, so a bf16 copy of the model holds the very
    same weights as the fp32 reference and only activation rounding differs.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    # The MTP layer (if any) is drawn last, so the main tensors are those of the same seed
    # without MTP.
    shapes = checkpoint_shapes(cfg)
    if cfg.num_nextn_predict_layers:
        shapes.update(mtp_shapes(cfg))
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + (0.05 * noise).clamp(-0.1, 0.1)
        elif name.endswith("e_score_correction_bias"):
            w = 0.05 * noise
        elif name == "lm_head.weight":
            # Rows of log-normal norms widen the gap between the best and second-best logit,
            # so greedy tokens stay the same between bf16 kernels and the fp32 reference
            # (transformers bf16 vs fp32, 16 seeds x 2 prompts: 25 of 32 runs of 24 greedy
            # tokens agree, against 18 of 32 with plain rows).
            row_scale = torch.exp(0.4 * torch.randn(shape[0], 1, generator=gen))
            w = _std(name) * noise * row_scale
        else:
            w = _std(name) * noise
        out[name] = w.to(torch.bfloat16).to(torch.float32)
    if cfg.num_nextn_predict_layers:  # DeepSeek-V3 stores these copies
        for copy, source in mtp_copy_names(cfg).items():
            out[copy] = out[source].clone()
    return out


def _is_fp8_candidate(name: str, t: torch.Tensor) -> bool:
    """Weight matrices DeepSeek-V3 ships in FP8 (not embeddings, norms, router gate or head)."""
    return (
        t.dim() == 2
        and name.startswith("model.layers.")
        and name.endswith(".weight")
        and not name.endswith(".mlp.gate.weight")
    )


def _quantize_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_fp8_candidate(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blockwise(t, FP8_BLOCK)
        else:
            out[name] = t
    return out


# ---- tokenizer ----------------------------------------------------------------------------------
def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on CORPUS; special tokens get ids 0-4."""
    return bpe_tokenizer(CORPUS.splitlines(keepends=True), vocab_size)


def bpe_tokenizer(lines: list[str], vocab_size: int):
    """A byte-level BPE trained on `lines` (the random model's and the trained model's setup)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # The post-processor adds bos like Llama-style tokenizers, so transformers' tokenizer and
    # ours agree on `encode(prompt)`.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


# ---- writer -------------------------------------------------------------------------------------
def make_random_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a tiny random deepseek_v3 model directory to `out_dir` and return its path.

    Args:
        seed: the weights are a function of (seed, config); the tokenizer is always the same.
        overrides: config keys replaced or added before the weights are drawn; a key set to
            None is written as null (e.g. {"q_lora_rank": None} for a V2-Lite style model).
        dtype: dtype of the stored non-FP8 tensors (router gate and bias stay float32).
        fp8: store layer weight matrices as float8_e4m3fn + `weight_scale_inv` (128x128 blocks)
            and add the matching `quantization_config`.
        max_shard_bytes: shard the weights (with an index) above this many bytes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-vocab // 64) * 64  # round up, like real checkpoints pad their embeddings
    raw = tiny_config(vocab, tok.token_to_id(BOS), tok.token_to_id(EOS), dtype)
    # None is written as JSON null: q_lora_rank null and rope_scaling null are meaningful.
    raw.update(overrides or {})
    if fp8:
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    cfg = ModelConfig.from_dict(raw)

    weights = random_weights(cfg, seed)
    weights = {
        name: t if name.endswith((".mlp.gate.weight", "e_score_correction_bias")) else t.to(dtype)
        for name, t in weights.items()
    }
    if fp8:
        weights = _quantize_fp8(weights)
    save_checkpoint(out_dir, weights, max_shard_bytes=max_shard_bytes)
    write_model_files(out_dir, tok, raw)
    _write_json(out_dir / VERSION_FILE, {"version": TINY_MODEL_VERSION, "seed": seed})
    return out_dir


def write_model_files(out_dir: Path, tok, raw: dict[str, Any]) -> None:
    """Everything but the weights: tokenizer, its config, generation config, config.json."""
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]},
    )
    _write_json(out_dir / "config.json", raw)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
