"""The trained tiny model: its training key, and the writer of its model directory.

`make_trained_tiny_model` trains the tiny deepseek_v3 config plus one MTP layer on the Python
standard library (`tinymodel.train_data`, `tinymodel.train`) and writes a directory like
`tinymodel.builder.make_random_tiny_model`'s, with the code tokenizer. The key names everything the
weights are a function of (training code version, seed, settings, config, corpus bytes), so a
cached copy is reused exactly when retraining would give the same files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from control.model_config import ModelConfig
from model.weight_names import mtp_copy_names
from model.weights import save_checkpoint
from tinymodel.builder import (
    BOS,
    CORPUS,
    EOS,
    TINY_MODEL_VERSION,
    VERSION_FILE,
    tiny_config,
    write_model_files,
)
from tinymodel.train import evaluate, train
from tinymodel.train_data import (
    TRAINED_VOCAB,
    encode_files,
    load_corpus,
    train_code_tokenizer,
    windows,
)
from tinymodel.train_settings import DEFAULT_SEED, TRAIN_VERSION, default_settings


def trained_config(vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of the trained model: the tiny config with one MTP layer."""

    raw = tiny_config(vocab_size, bos_id, eos_id, torch.float32)
    raw["num_nextn_predict_layers"] = 1
    return raw


def training_key(seed: int = DEFAULT_SEED, settings=None) -> str:
    """sha256 of what the trained files depend on; reads the corpus (a few MB), trains nothing."""

    settings = settings or default_settings()
    parts = {
        "train_version": TRAIN_VERSION,
        "tiny_model_version": TINY_MODEL_VERSION,
        "seed": seed,
        "settings": settings.key(),
        "config": trained_config(TRAINED_VOCAB, None, None),
        "corpus": load_corpus().digest,
        "tokenizer_extra_text": hashlib.sha256(CORPUS.encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def prepare(seed: int = DEFAULT_SEED, settings=None):
    """(tokenizer, ModelConfig, raw config, train samples, held-out samples)."""

    settings = settings or default_settings()
    corpus = load_corpus()
    tok = train_code_tokenizer(corpus, CORPUS)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    raw = trained_config(vocab, bos, eos)
    cfg = ModelConfig.from_dict(raw)
    train = windows(encode_files(tok, corpus.train, eos), settings.seq_len, bos)
    held_out = windows(encode_files(tok, corpus.held_out, eos), settings.seq_len, bos)
    return tok, cfg, raw, train, held_out


def checkpoint_tensors(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """The stored weights: fp32 holding bf16-representable values (as `random_weights`), plus
    the MTP layer's copies of the embedding and head that DeepSeek-V3 checkpoints carry."""
    out = {name: t.detach().to(torch.bfloat16).to(torch.float32) for name, t in params.items()}
    for copy, source in mtp_copy_names(cfg).items():
        out[copy] = out[source].clone()
    return out


def make_trained_tiny_model(
    out_dir: str | Path, seed: int = DEFAULT_SEED, settings=None, progress: bool | None = None
) -> Path:
    """Train the tiny model (a minute or two on 2 cores) and write its directory to `out_dir`."""

    settings = settings or default_settings()
    key = training_key(seed, settings)
    tok, cfg, raw, data, held_out = prepare(seed, settings)
    params, history = train(cfg, data, seed, settings, progress)
    weights = checkpoint_tensors(params, cfg)
    out_dir = Path(out_dir)
    save_checkpoint(out_dir, weights)
    stored = {name: weights[name] for name in params}
    figures = evaluate(stored, cfg, held_out[:64])
    write_model_files(out_dir, tok, raw)
    info = {
        "version": _tiny_model_version(),
        "trained": True,
        "key": key,
        "seed": seed,
        "steps": settings.steps,
        "final_train_loss": sum(history[-10:]) / len(history[-10:]),
        "held_out": figures,
    }
    (out_dir / VERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


def _tiny_model_version() -> int:

    return TINY_MODEL_VERSION
