"""`duet` command line. Each subcommand imports its implementation lazily, so `duet --help`
stays fast. A user-facing error (control.errors.DuetError) prints one line and exits 1."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from control.errors import ConfigError, DuetError
from control.quant_schemes import DEFAULT_DRAFT_HEAD, DRAFT_HEAD_SCHEMES, QUANT_SCHEMES
from model.sharding import SCHEMES as PARALLEL_SCHEMES

DTYPES = ("float32", "bfloat16")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _parse_logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError
        return tuple((int(k), float(v)) for k, v in raw.items())
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f'--logit-bias must be a JSON object {{"token id": bias, ...}}: {text!r}'
        ) from None


def _parse_structured(text: str) -> tuple[str, str]:
    """`KIND:SPEC` (SPEC `@FILE`: the file's text) -> SamplingParams' (kind, spec)."""
    kind, sep, spec = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--structured must be KIND:SPEC, got {text!r}")
    if spec.startswith("@"):
        try:
            with open(spec[1:], encoding="utf-8") as f:
                spec = f.read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"--structured: {exc}") from None
    return kind, spec


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="offline generation (chunked prefill + paged decode)")
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, tokenized as /v1/completions does")
    src.add_argument("--prompt-ids", type=_parse_ids, help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument(
        "--logit-bias", type=_parse_logit_bias, default=(), help='JSON: {"token id": bias, ...}'
    )
    p.add_argument("--stop-token-ids", type=_parse_ids, default=[], help="comma-separated ids")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--structured",
        type=_parse_structured,
        default=None,
        metavar="KIND:SPEC",
        help="constrain the output: json_object:, json_schema:SCHEMA, regex:RE, "
        'choice:["a","b"], grammar:LARK; SPEC "@FILE" reads it from FILE',
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument(
        "--quant", choices=QUANT_SCHEMES, default="none", help="weight quantization (model.quant)"
    )
    p.add_argument(
        "--prefill-quant", choices=QUANT_SCHEMES, help="the prefill's own, as a PD prefill node's"
    )
    p.add_argument(
        "--decode-quant", choices=QUANT_SCHEMES, help="the decode steps' own (a decode node's)"
    )
    _add_quant_attention(p)
    _add_quant_lm_head(p)
    p.add_argument(
        "--mtp-tokens",
        type=int,
        default=0,
        help="speculate with the model's MTP layer, this many drafts a step (0: off)",
    )
    p.add_argument(
        "--mtp-draft-head",
        choices=DRAFT_HEAD_SCHEMES,
        default=DEFAULT_DRAFT_HEAD,
        help="the LM head the drafts run through (a node's mtp_draft_head; none: the main head)",
    )
    _add_pack_options(p)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import torch

    from control.sampling_params import SamplingParams
    from control.tokenizer import Tokenizer
    from model.pack_cache import load_model
    from native import ops
    from runtime.generate import OfflineGenerator
    from tinymodel.make import ensure_tiny_model

    if args.threads:
        ops.set_num_threads(args.threads)
    from control.errors import InvalidRequestError

    if args.prompt == "":
        raise InvalidRequestError("the prompt is empty")
    model_dir = args.model or str(ensure_tiny_model())
    tokenizer = Tokenizer(model_dir)
    prompt_ids = args.prompt_ids if args.prompt is None else tokenizer.encode_prompt(args.prompt)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        logit_bias=args.logit_bias,
        structured=args.structured,
    )
    dtype = getattr(torch, args.dtype)
    prefill_quant = args.prefill_quant or args.quant
    decode_quant = args.decode_quant or args.quant
    mtp = args.mtp_tokens > 0
    if args.pack and decode_quant != prefill_quant:
        raise InvalidRequestError("--pack holds one scheme: drop --prefill-quant/--decode-quant")
    load = lambda quant: load_model(  # noqa: E731
        model_dir,
        dtype,
        quant,
        mtp=mtp,
        progress=not args.json,
        pack=args.pack,
        weights_cache=args.weights_cache,
        quant_lm_head=args.quant_lm_head,
        quant_attention=args.quant_attention,
    )
    model = load(prefill_quant)
    decode_model = None if decode_quant == prefill_quant else load(decode_quant)
    if mtp:
        from runtime.speculative_generate import SpeculativeGenerator

        if decode_model is not None:
            raise InvalidRequestError("--mtp-tokens with two quantizations is not supported")
        model.set_draft_head(args.mtp_draft_head)
        generator = SpeculativeGenerator(
            model, args.mtp_tokens, page_size=args.page_size, chunk_size=args.chunk_size
        )
    else:
        generator = OfflineGenerator(
            model, page_size=args.page_size, chunk_size=args.chunk_size, decode_model=decode_model
        )
    result = generator.generate(prompt_ids, params)
    text = tokenizer.decode(result.token_ids)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text}))
    else:
        print(text)
    return 0


def _add_pack_options(p) -> None:
    """--pack / --weights-cache: load through a packed weight store (model.pack_cache)."""
    p.add_argument("--pack", help="map this packed weight store (made by duet pack)")
    p.add_argument(
        "--weights-cache",
        action="store_true",
        help="build the checkpoint's pack once under the cache dir, then map it",
    )


def _add_quant_attention(p) -> None:
    """--quant-attention: the attention projections' scheme (a node's `quant_attention`)."""
    p.add_argument(
        "--quant-attention",
        choices=QUANT_SCHEMES,
        help="the attention projections' weight quantization (default: --quant's, int8 under int4)",
    )


def _add_quant_lm_head(p) -> None:
    """--quant-lm-head: the LM head in int8 whatever --quant is (a node's `quant_lm_head`)."""
    p.add_argument(
        "--quant-lm-head",
        action="store_true",
        help="run the LM head in int8 W8A8 whatever the weight quantization (model.quant)",
    )


def _parse_shard(text: str) -> tuple[int, int]:
    rank, sep, world = text.partition("/")
    try:
        if sep and 0 <= int(rank) < int(world):
            return int(rank), int(world)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK/WORLD with 0 <= RANK < WORLD, got {text!r}")


def _add_pack(sub) -> None:
    p = sub.add_parser(
        "pack", help="write a model's packed weight store: the kernels' layout, mapped at load"
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--quant", choices=QUANT_SCHEMES, default="none")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--out", required=True, help="the pack file to write")
    p.add_argument("--mtp", action="store_true", help="include the MTP layer (mtp = true nodes)")
    _add_quant_attention(p)
    _add_quant_lm_head(p)
    p.add_argument(
        "--tensor-parallel",
        type=_parse_shard,
        metavar="RANK/WORLD",
        help="the shard of tensor-parallel prefill rank RANK of WORLD",
    )
    p.add_argument("--parallel", choices=PARALLEL_SCHEMES, default="tp", help="the TP scheme")
    p.set_defaults(func=_run_pack)


def _run_pack(args) -> int:
    import torch

    from model.pack_cache import build_pack, pack_spec
    from tinymodel.make import ensure_tiny_model

    model_dir = args.model or str(ensure_tiny_model())
    dtype = getattr(torch, args.dtype)
    # Expert-parallel ranks map the whole model's pack (each takes its experts out of it).
    spec = pack_spec(
        model_dir,
        dtype,
        args.quant,
        None,
        args.tensor_parallel,
        args.parallel,
        args.mtp,
        args.quant_lm_head,
        args.quant_attention,
    )
    stats = build_pack(model_dir, args.out, spec, progress=True)
    print(f"{args.out}: {stats}")
    return 0


def _add_make_tiny_model(sub) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="train a small deepseek_v3 checkpoint (with an MTP layer) on the Python stdlib",
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--random", action="store_true", help="random weights instead (instant, no MTP layer)"
    )
    p.set_defaults(func=_run_make_tiny_model)


def _run_make_tiny_model(args) -> int:
    from tinymodel.make import make_tiny_model

    print(make_tiny_model(args.out, seed=args.seed, random=args.random))
    return 0


def _add_keygen(sub) -> None:
    p = sub.add_parser("keygen", help="write the cluster's CURVE key pair (node authentication)")
    p.add_argument("out_dir", help="directory for the key file (created if missing)")
    p.add_argument("--force", action="store_true", help="replace an existing key file")
    p.set_defaults(func=_run_keygen)


def _run_keygen(args) -> int:
    from pathlib import Path

    from control.security import KEY_FILE_NAME, security_toml, write_key_file

    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DuetError(f"{out_dir}: cannot create the directory ({exc.strerror})") from None
    path = out_dir / KEY_FILE_NAME
    write_key_file(path, force=args.force)
    print(f"# wrote {path.resolve()} (mode 0600): copy it to every host of the cluster, keep it")
    print("# secret, and put these lines in the cluster config:")
    print(security_toml(path), end="")
    return 0


def _add_node(sub) -> None:
    p = sub.add_parser(
        "node",
        help="start one node that joins a running cluster (it is not in the config)",
        description="A prefill or decode node with the settings of the config's first node of "
        "its role, under its own name and ports; the router (the config's) admits it once its "
        "model and KV layout check out, pairs requests with it, and forgets it when it drains "
        "(SIGTERM) or dies.",
    )
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--config", required=True, help="the running cluster's config (TOML)")
    p.add_argument("--name", required=True, help="its name: not one of the config's")
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument("--kv-port", type=int, default=0, help="decode: its KV port")
    p.add_argument("--host", default="", help="where the others reach it (default: the role's)")
    p.add_argument("--model", help="checkpoint dir (default: the config's)")
    p.set_defaults(func=_node)


def _node(args: argparse.Namespace) -> int:
    if args.role == "decode" and not args.kv_port:
        raise ConfigError("a decode node needs --kv-port")
    argv = ["--config", args.config, "--node", args.name, "--join"]
    argv += ["--control-port", str(args.control_port)]
    for flag, value in (
        ("--kv-port", args.kv_port),
        ("--host", args.host),
        ("--model", args.model),
    ):
        if value:
            argv += [flag, str(value)]
    return _call(f"{args.role}_node.__main__:main", argv)


def _add_passthrough(sub, name: str, help_text: str, target: str) -> None:
    """Subcommands whose module parses its own arguments: `module:function(argv)`."""
    # No option prefix of its own: REMAINDER would otherwise leave a leading "--opt" unparsed.
    p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _call(target, args.rest))


def _call(target: str, argv: list[str]) -> int:
    import importlib

    module_name, func_name = target.split(":")
    func: Callable[[list[str]], int | None] = getattr(
        importlib.import_module(module_name), func_name
    )
    return func(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_pack(sub)
    _add_make_tiny_model(sub)
    _add_keygen(sub)
    _add_node(sub)
    _add_passthrough(sub, "bench-kernels", "kernel benchmark vs roofline", "bench.kernels:main")
    _add_passthrough(sub, "bench-transfer", "KV transfer benchmark", "bench.transfer:main")
    _add_passthrough(
        sub,
        "bench-ttft",
        "TTFT added by disaggregation vs prefill alone",
        "bench.ttft_overhead:main",
    )
    _add_passthrough(sub, "bench-serve", "serving benchmark (OpenAI API)", "bench.serve:main")
    _add_passthrough(
        sub,
        "bench-e2e",
        "offline TTFT, TPOT, memory and accuracy per quantization",
        "bench.e2e:main",
    )
    _add_passthrough(
        sub,
        "bench-masks",
        "structured output: the mask cost per decode step",
        "bench.structured_masks:main",
    )
    _add_passthrough(sub, "bench-sweep", "bench-serve over rates and configs", "bench.sweep:main")
    _add_passthrough(
        sub, "make-bench-model", "random V2-Lite-shaped checkpoint", "tinymodel.bench_model:main"
    )
    _add_passthrough(sub, "up", "run a whole cluster on this machine", "deploy.local_cluster:main")
    _add_passthrough(sub, "status", "every node as the router sees it", "deploy.status:main")
    _add_passthrough(sub, "plan", "the xPyD layout that meets an SLA", "deploy.plan:main")
    _add_passthrough(sub, "k8s", "Kubernetes manifests of a cluster", "deploy.k8s_render:main")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DuetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
