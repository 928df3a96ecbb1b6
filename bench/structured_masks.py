"""`duet bench-masks`: what structured output costs a decode step, and whether computing the
masks on a helper thread during the forward (as the decode node does) hides that cost.

B rows each follow a JSON schema (`--schema FILE`, default a small object with an enum, an
integer, a bounded string and an array); every step each row takes a random token its grammar
allows (a fresh matcher once a row completes), so the rows sit at every place of the grammar.
Timed per step, medians over `--steps`:
  fill     llguidance's parallel bitmask of the B rows (`LLExecutor`, GIL released)
  bias     the bitmask turned into the 0 / -inf bias [B, V]
  apply    logits + bias (what is left on the sampling path when the masks overlap)
  forward  one decode forward of the model at batch B (`--model`, default the tiny model)
  serial   forward, then fill + bias            overlap  fill + bias on the helper thread
Run: `duet bench-masks --model /work/bench-model --batch 1 8 32 --threads 4` (idle machine);
`--masks-only` times the mask phases alone (the weights are not read). `--tool-call hermes` (or
deepseek_v3): the rows write a forced tool call instead (`tool_choice: "required"`, one function
whose arguments follow the schema), in that parser's format: a constrained call's cost per step
against `forward` alone, which is what a free-text step costs. `--vocab N --masks-only`: the
masks over a tokenizer of N tokens (`bench.synthetic_vocab`; DeepSeek's have 129 280, the
built-in model 2048).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.synthetic_vocab import synthetic_vocab_model
from control.cluster_config import TOOL_PARSERS
from router.tools import Tool, ToolChoice, call_grammar

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["color", "count", "name", "tags"],
    "additionalProperties": False,
}
CONTEXT = 256  # tokens of KV each row attends to in the timed forward


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duet bench-masks", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: the tiny model)")
    p.add_argument("--schema", help="JSON schema file (default: a small bounded object)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="kernel threads of the forward")
    p.add_argument("--mask-threads", type=int, default=2, help="llguidance's workers")
    p.add_argument("--masks-only", action="store_true", help="no forward: the weights stay unread")
    p.add_argument("--tool-call", choices=TOOL_PARSERS, help="rows write a forced tool call")
    p.add_argument("--vocab", type=int, help="a synthetic tokenizer of this many tokens")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


class Rows:
    """B matchers walking their grammar by random allowed tokens."""

    def __init__(self, grammars, structured, batch: int, seed: int = 0):
        self.grammars, self.structured = grammars, structured
        self.matchers = [grammars.matcher(structured) for _ in range(batch)]
        self.gen = torch.Generator().manual_seed(seed)

    def advance(self, bias: torch.Tensor) -> None:
        noise = torch.rand(bias.shape, generator=self.gen)  # [B, V]
        tokens = (noise + bias).argmax(-1).tolist()
        for i, token in enumerate(tokens):
            m = self.matchers[i]
            if m.is_finished or not m.consume(token):
                self.matchers[i] = self.grammars.matcher(self.structured)


def decode_forward(model, batch: int):
    """A callable running one decode forward at batch `batch` over CONTEXT cached positions."""
    from model.batch import ForwardBatch

    pool = model.new_kv_pool(batch * (CONTEXT // 16 + 2), 16)
    tables = [pool.new_table() for _ in range(batch)]
    for table in tables:
        pool.reserve(table, CONTEXT + 1)

    def run():
        fb = ForwardBatch.build(pool, tables, [[5]] * batch, [CONTEXT] * batch, is_decode=True)
        return model.forward(fb, pool)

    return run


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 3)


def bench_batch(model, grammars, structured, batch: int, steps: int) -> dict:
    """`model` None: the mask phases only (fill, bias, apply on random logits)."""
    from runtime.grammar import bitmask_bias, compute_masks

    rows = Rows(grammars, structured, batch)
    vocab = grammars.vocab_size
    if model is None:
        logits = torch.randn(batch, vocab)
        forward = lambda: logits  # noqa: E731
    else:
        forward = decode_forward(model, batch)
    t = {k: [] for k in ("fill", "bias", "apply", "forward", "serial", "overlap")}
    forward()  # warm up
    for _ in range(steps):
        start = time.perf_counter()
        words = rows.matchers[0].mask_words
        bitmask = torch.empty(batch, words, dtype=torch.int32)
        targets = [(m._matcher, k) for k, m in enumerate(rows.matchers)]
        grammars.executor.unsafe_compute_mask_ptr(targets, bitmask.data_ptr(), words * 4, batch)
        filled = time.perf_counter()
        bias = bitmask_bias(bitmask, vocab)
        t["fill"].append(filled - start)
        t["bias"].append(time.perf_counter() - filled)

        start = time.perf_counter()
        logits = forward()
        t["forward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        _ = logits + bias
        t["apply"].append(time.perf_counter() - start)

        start = time.perf_counter()
        forward()
        compute_masks(rows.matchers, vocab, grammars.executor)
        t["serial"].append(time.perf_counter() - start)
        start = time.perf_counter()
        pending = grammars.start_masks(rows.matchers)
        forward()
        pending.result()
        t["overlap"].append(time.perf_counter() - start)
        rows.advance(bias)
    out = {"batch": batch, **{f"{k}_ms": median_ms(v) for k, v in t.items()}}
    out["mask_ms_per_row"] = round((out["fill_ms"] + out["bias_ms"] + out["apply_ms"]) / batch, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    from control.model_config import ModelConfig
    from model.deepseek import DeepseekModel
    from native import ops
    from runtime.grammar import Grammars
    from tinymodel.make import ensure_tiny_model

    args = parse_args(argv)
    ops.set_num_threads(args.threads)
    model_dir = args.model or str(ensure_tiny_model())
    if args.vocab is not None:
        if not args.masks_only:
            raise SystemExit("--vocab needs --masks-only: no model has that vocabulary")
        scratch = tempfile.TemporaryDirectory(prefix="duet-vocab-")
        out = Path(scratch.name) / "model"
        model_dir = str(synthetic_vocab_model(args.vocab, out, Path(model_dir)))
    model = None
    if args.masks_only:
        cfg = ModelConfig.from_model_dir(model_dir)
    else:
        model = DeepseekModel.from_pretrained(model_dir, torch.bfloat16, progress=False)
        cfg = model.cfg
    grammars = Grammars(model_dir, cfg.vocab_size, cfg.eos_token_id, args.mask_threads)
    schema = DEFAULT_SCHEMA
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    structured = ("json_schema", json.dumps(schema))
    if args.tool_call:
        tool = Tool("describe", schema, {})
        lark = call_grammar(args.tool_call, [tool], ToolChoice("required"), parallel=False)
        structured = ("grammar", lark)
    results = [bench_batch(model, grammars, structured, b, args.steps) for b in args.batch]
    grammars.close()
    if args.json:
        print(json.dumps({"model": model_dir, "vocab_size": cfg.vocab_size, "results": results}))
        return 0
    what = f"a forced {args.tool_call} tool call" if args.tool_call else "a JSON schema"
    print(
        f"model {model_dir} (vocab {cfg.vocab_size}), rows writing {what}; medians over "
        f"{args.steps} steps, ms"
    )
    keys = ["batch", "fill_ms", "bias_ms", "apply_ms", "mask_ms_per_row", "forward_ms"]
    keys += [] if args.masks_only else ["serial_ms", "overlap_ms"]
    print("  ".join(f"{k:>15}" for k in keys))
    for r in results:
        print("  ".join(f"{r[k]:>15}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
