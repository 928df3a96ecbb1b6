"""Training twin of the DeepSeek model, for the tiny checkpoint: plain torch with autograd.

The same math as `model.deepseek` (and `native.reference`), written for whole sequences at once:
non-absorbed causal MLA with the model's softmax scale (YaRN mscale included) and rope tables,
a dense MLP in the first layers, MoE layers routed exactly as `model.layers.MoE.route` (the
reference `grouped_topk`; the top-k choice carries no gradient, the chosen weights do), shared
experts, RMSNorm. Parameters live under their checkpoint names, so the parameter dict IS the
checkpoint. The MTP layer (DeepSeek-V3, layer index N = num_hidden_layers) predicts the token
after next from the main model's last residual stream and the next token's embedding.

Nothing in the serving path imports this module; `tinymodel.builder` calls `train`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from control.model_config import ModelConfig
from model.rope import rope_cos_sin
from model.weight_names import checkpoint_shapes, mtp_shapes
from native.reference import grouped_topk
from tinymodel.train_settings import TrainSettings

Params = dict[str, torch.Tensor]

MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
BIAS_UPDATE = 1e-3  # aux-loss-free balancing: the router bias step per training step


# ---- the network ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (DeepSeek) rotation of pairs (x[2i], x[2i+1]); cos, sin broadcast to x[..., ::2]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def attention(p: Params, cfg: ModelConfig, prefix: str, x, cos_sin) -> torch.Tensor:
    """Causal MLA over whole sequences. x: [B, T, D]; cos_sin: [T, R] of the rope positions."""
    b, t, _ = x.shape
    h, dn, r, lr = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.kv_lora_rank,
    )
    if cfg.q_lora_rank is None:
        q = x @ p[f"{prefix}.q_proj.weight"].T
    else:
        q_a = rms_norm(
            x @ p[f"{prefix}.q_a_proj.weight"].T,
            p[f"{prefix}.q_a_layernorm.weight"],
            cfg.rms_norm_eps,
        )
        q = q_a @ p[f"{prefix}.q_b_proj.weight"].T
    q = q.view(b, t, h, cfg.qk_head_dim)
    q_nope, q_pe = q.split([dn, r], dim=-1)
    kv_a = x @ p[f"{prefix}.kv_a_proj_with_mqa.weight"].T  # [B, T, L + R]
    c_kv = rms_norm(kv_a[..., :lr], p[f"{prefix}.kv_a_layernorm.weight"], cfg.rms_norm_eps)
    cos, sin = cos_sin[:, : r // 2], cos_sin[:, r // 2 :]
    q_pe = rope(q_pe, cos[:, None, :], sin[:, None, :])
    k_pe = rope(kv_a[..., lr:], cos, sin)  # [B, T, R], one key rope shared by the heads
    kv = (c_kv @ p[f"{prefix}.kv_b_proj.weight"].T).view(b, t, h, dn + cfg.v_head_dim)
    k_nope, v = kv.split([dn, cfg.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, :, None, :].expand(b, t, h, r)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=cfg.softmax_scale,
    )
    out = out.transpose(1, 2).reshape(b, t, h * cfg.v_head_dim)
    return out @ p[f"{prefix}.o_proj.weight"].T


def mlp(p: Params, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ p[f"{prefix}.gate_proj.weight"].T
    up = x @ p[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ p[f"{prefix}.down_proj.weight"].T


def route(p: Params, cfg: ModelConfig, prefix: str, x: torch.Tensor):
    """x: [N, D] -> (weights [N, K], ids [N, K]): `model.layers.MoE.route`'s grouped top-k."""
    bias = p.get(f"{prefix}.gate.e_score_correction_bias")
    return grouped_topk(
        x @ p[f"{prefix}.gate.weight"].T,
        None if bias is None else bias.detach(),
        cfg.num_experts_per_tok,
        cfg.n_group,
        cfg.topk_group,
        cfg.scoring_func,
        cfg.topk_method,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )


def moe(p: Params, cfg: ModelConfig, prefix: str, x: torch.Tensor, loads: dict | None):
    """Routed experts (weighted by the router) plus the shared experts. x: [B, T, D]."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = route(p, cfg, prefix, flat)
    ids = ids.long()
    if loads is not None:  # tokens per expert, for the aux-loss-free bias update
        loads[prefix] = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
    out = torch.zeros_like(flat)
    for e in range(cfg.n_routed_experts):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel():
            y = mlp(p, f"{prefix}.experts.{e}", flat.index_select(0, token_idx))
            out = out.index_add(0, token_idx, y * weights[token_idx, slot, None])
    if cfg.n_shared_experts:
        out = out + mlp(p, f"{prefix}.shared_experts", flat)
    return out.view_as(x)


def decoder_layer(p: Params, cfg: ModelConfig, idx: int, x, cos_sin, loads=None):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Returns the new residual stream."""
    prefix, eps = f"model.layers.{idx}", cfg.rms_norm_eps
    x = x + attention(
        p,
        cfg,
        f"{prefix}.self_attn",
        rms_norm(x, p[f"{prefix}.input_layernorm.weight"], eps),
        cos_sin,
    )
    y = rms_norm(x, p[f"{prefix}.post_attention_layernorm.weight"], eps)
    if cfg.is_moe_layer(idx):  # the MTP layer (idx N) too, as `mtp_shapes` lists it
        return x + moe(p, cfg, f"{prefix}.mlp", y, loads)
    return x + mlp(p, f"{prefix}.mlp", y)


def _cos_sin(cfg: ModelConfig, length: int) -> torch.Tensor:
    return rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)[:length]


def main_forward(p: Params, cfg: ModelConfig, ids: torch.Tensor, loads=None):
    """ids: [B, T] -> (logits [B, T, V], h [B, T, D]: the residual stream before the final norm)."""
    cos_sin = _cos_sin(cfg, ids.shape[1])
    # F.embedding, not indexing: its backward sums in a fixed order (indexing's index_put_
    # accumulates in thread order, and two trainings of one seed would differ).
    h = F.embedding(ids, p["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        h = decoder_layer(p, cfg, i, h, cos_sin, loads)
    out = rms_norm(h, p["model.norm.weight"], cfg.rms_norm_eps)
    return out @ p["lm_head.weight"].T, h


def mtp_forward(p: Params, cfg: ModelConfig, ids: torch.Tensor, h: torch.Tensor, loads=None):
    """MTP logits [B, T-1, V]: position i (rope position i) sees h_i and t_{i+1}, predicts t_{i+2}."""
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    prefix = f"model.layers.{n}"
    emb = F.embedding(ids[:, 1:], p["model.embed_tokens.weight"])
    emb = rms_norm(emb, p[f"{prefix}.enorm.weight"], eps)
    hid = rms_norm(h[:, :-1], p[f"{prefix}.hnorm.weight"], eps)
    x = torch.cat((emb, hid), dim=-1) @ p[f"{prefix}.eh_proj.weight"].T
    x = decoder_layer(p, cfg, n, x, _cos_sin(cfg, x.shape[1]), loads)
    out = rms_norm(x, p[f"{prefix}.shared_head.norm.weight"], eps)
    return out @ p["lm_head.weight"].T


@torch.no_grad()
def main_logits(params: Params, cfg: ModelConfig, token_ids) -> torch.Tensor:
    """[T, V] fp32: the main model's logits at every position of t_0..t_{T-1}."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64)[None]
    return main_forward(_fp32(params), cfg, ids)[0][0]


@torch.no_grad()
def mtp_logits(params: Params, cfg: ModelConfig, token_ids) -> torch.Tensor:
    """[T-1, V] fp32: position i's MTP logits (for t_{i+2}) given t_0..t_{T-1}."""
    p = _fp32(params)
    ids = torch.as_tensor(token_ids, dtype=torch.int64)[None]
    _, h = main_forward(p, cfg, ids)
    return mtp_forward(p, cfg, ids, h)[0]


def _fp32(params: Params) -> Params:
    return {name: t.float() for name, t in params.items()}


# ---- parameters ----------------------------------------------------------------------------------
def param_shapes(cfg: ModelConfig) -> dict:
    return {**checkpoint_shapes(cfg), **mtp_shapes(cfg)}


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Seeded initialization: norms 1, router bias 0, matrices N(0, 1/fan_in) with the residual
    outputs (o_proj, down_proj) shrunk by the depth, embeddings N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = (2 * (cfg.num_hidden_layers + 1)) ** -0.5
    params: Params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            w = torch.zeros(shape)
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= depth_scale
            w = torch.randn(shape, generator=gen) * std
        params[name] = w.requires_grad_(not name.endswith("e_score_correction_bias"))
    return params


def _decays(name: str) -> bool:
    return name.endswith(".weight") and not name.endswith("norm.weight")


# ---- training ------------------------------------------------------------------------------------
def losses(p: Params, cfg: ModelConfig, batch: torch.Tensor, loads=None):
    """batch [B, T+1] -> (main next-token CE, MTP token-after-next CE), mean nats per token."""
    ids, targets = batch[:, :-1], batch[:, 1:]
    logits, h = main_forward(p, cfg, ids, loads)
    main = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    mtp = mtp_forward(p, cfg, ids, h, loads)  # position i predicts t_{i+2} = targets[i + 1]
    extra = F.cross_entropy(mtp.flatten(0, 1), targets[:, 1:].flatten())
    return main, extra


def _lr(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@contextmanager
def _threads(n: int) -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def train(
    cfg: ModelConfig,
    data: torch.Tensor,
    seed: int = 0,
    settings: TrainSettings = TrainSettings(),
    progress: bool | None = None,
) -> tuple[Params, list[float]]:
    """Trains every tensor of `param_shapes(cfg)` on `data` ([N, seq_len + 1] samples), in one
    seeded order. Returns (the fp32 parameters, the main loss of each step)."""
    if progress is None:
        progress = sys.stderr.isatty()
    torch.manual_seed(seed)
    params = init_params(cfg, seed)
    trainable = [t for t in params.values() if t.requires_grad]
    decay = [t for n, t in params.items() if t.requires_grad and _decays(n)]
    rest = [t for n, t in params.items() if t.requires_grad and not _decays(n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    order = torch.randperm(data.shape[0], generator=torch.Generator().manual_seed(seed))
    history: list[float] = []
    bar = _progress_bar(settings.steps) if progress else None
    with _threads(settings.threads):
        for step in range(settings.steps):
            start = (step * settings.batch) % max(1, data.shape[0] - settings.batch + 1)
            batch = data[order[start : start + settings.batch]]
            for group in opt.param_groups:
                group["lr"] = _lr(step, settings)
            loads: dict = {}
            main, extra = losses(params, cfg, batch, loads)
            opt.zero_grad(set_to_none=True)
            (main + MTP_LOSS_WEIGHT * extra).backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            _balance(params, loads)
            history.append(main.item())
            if bar is not None:
                bar(step + 1, main.item(), extra.item())
    if bar is not None:
        print(file=sys.stderr)
    return {n: t.detach() for n, t in params.items()}, history


@torch.no_grad()
def _balance(params: Params, loads: dict) -> None:
    """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts."""
    for prefix, load in loads.items():
        bias = params[f"{prefix}.gate.e_score_correction_bias"]
        bias += BIAS_UPDATE * torch.sign(load.float().mean() - load.float())


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, desc="training the tiny model", file=sys.stderr, leave=False)

        def update(step: int, loss: float, mtp: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", mtp=f"{mtp:.3f}", refresh=False)
            if step == total:
                bar.close()

        return update
    began = time.monotonic()

    def line(step: int, loss: float, mtp: float) -> None:
        print(
            f"\rtraining the tiny model: step {step}/{total} loss {loss:.3f} mtp {mtp:.3f} "
            f"({time.monotonic() - began:.0f} s)",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return line


# ---- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(params: Params, cfg: ModelConfig, data: torch.Tensor, batch: int = 16) -> dict:
    """Held-out figures over samples [N, T+1]: main and MTP loss (nats/token), MTP top-1
    accuracy of the token after next."""
    p = _fp32(params)
    main_sum = mtp_sum = hits = count = mtp_count = 0.0
    for start in range(0, data.shape[0], batch):
        rows = data[start : start + batch]
        ids, targets = rows[:, :-1], rows[:, 1:]
        logits, h = main_forward(p, cfg, ids)
        main_sum += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        mtp = mtp_forward(p, cfg, ids, h)
        after_next = targets[:, 1:]
        mtp_sum += F.cross_entropy(mtp.flatten(0, 1), after_next.flatten(), reduction="sum")
        hits += (mtp.argmax(-1) == after_next).sum().item()
        count += targets.numel()
        mtp_count += after_next.numel()
    return {
        "loss": float(main_sum) / count,
        "mtp_loss": float(mtp_sum) / mtp_count,
        "mtp_accuracy": hits / mtp_count,
    }
