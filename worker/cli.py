"""`kvscale-worker`: the worker's command line.

    kvscale-worker generate [--model PATH] [--prompt TEXT ...] [engine flags]
    kvscale-worker serve [--model PATH] [--host H --port P] [--served-model-name N] [--api-key K]
                         [--max-queued-requests N] [--drain-timeout S] [engine flags]
    kvscale-worker download hf://ORG/NAME[@REVISION] --dest DIR [--termination-log PATH] [--check]
    kvscale-worker compile [--model PATH] [--dtype D] [--block-size N] [--compile-cache-dir DIR]
                           [--enable-lora]

Without --model it builds (once, in ~/.cache/kvscale) a tiny random Llama with a locally trained
tokenizer, so the command works on a fresh machine with no download.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvscale.common.json_logging import configure_logging
from kvscale.worker.config import EngineArgs
from kvscale.worker.server.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
]


BUILTIN = "builtin://tiny-llama"


def resolve_model(model: str | None) -> str:
    """A model folder path; none, or `builtin://tiny-llama`, means the built-in tiny model."""
    if not model or model == BUILTIN:
        return _default_model()
    if model.startswith("builtin://"):
        raise ValueError(f"unknown built-in model {model!r}; the one built-in model is {BUILTIN}")
    return model.removeprefix("file://")


def _default_model() -> str:
    import os
    import shutil

    from kvscale.worker.testing.tiny_model import build_tiny_model, default_model_dir

    path = default_model_dir()
    if not (path / "model.safetensors").is_file():
        print(f"building the built-in tiny model in {path} (random weights, no download)...", file=sys.stderr)
        # Built aside and renamed into place: workers starting together never see half a folder.
        scratch = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        build_tiny_model(scratch)
        try:
            scratch.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(path)


def serve_follower_node(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """--node-rank > 0: this host only runs its tensor-parallel ranks and answers the probes."""
    import asyncio

    from kvscale.worker.executor.follower_node import serve_follower_node

    host, port = getattr(args, "host", None), getattr(args, "port", 8000)
    return asyncio.run(serve_follower_node(engine_args, host, port))


def cmd_generate(args: argparse.Namespace) -> int:
    from kvscale.worker import LLM, SamplingParams

    args.model = resolve_model(args.model)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.node_rank > 0:
        return serve_follower_node(args, engine_args)
    started = time.monotonic()
    llm = LLM(**vars(engine_args))
    loaded = time.monotonic()
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    try:
        outputs = llm.generate(prompts, params)
    finally:
        # Stops the tensor-parallel ranks, if any. A compile still building behind is left to finish
        # (its own session): this run served eagerly, the next one loads what it builds.
        llm.engine.shutdown(keep_compiling=True)
    compiler = llm.engine.runner.compiler
    if compiler is not None and not compiler.done.is_set():
        print(
            f"the compiled forward is still being built in the background (pid {compiler.process.pid}); "
            "this run used the eager forward, the next one loads the compiled one",
            file=sys.stderr,
        )
    elapsed = time.monotonic() - loaded
    for out in outputs:
        completion = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{completion.text!r} [{completion.finish_reason}]")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {
        "model": args.model,
        "requests": len(outputs),
        "output_tokens": num_tokens,
        "load_s": round(loaded - started, 2),
        "forward": llm.engine.runner.forward_kind,
        "generate_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_tokens / elapsed, 1),
        "mean_ttft_s": round(
            sum(o.outputs[0].metrics.time_to_first_token for o in outputs) / len(outputs), 4
        ),
    }
    print(json.dumps(summary))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    args.model = resolve_model(args.model)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.node_rank > 0:
        return serve_follower_node(args, engine_args)
    engine = None
    if engine_args.engine_process:  # first: it loads the model while this process imports the server
        from kvscale.worker.engine.core_launch import EngineProcess

        engine = EngineProcess.spawn(engine_args)
    from kvscale.worker.server.api_server import ServerConfig, serve
    from kvscale.worker.server.lora_serving import LoRAServingConfig, parse_lora_modules

    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("KVSCALE_API_KEY") or None,
        max_queued_requests=args.max_queued_requests,
        tool_call_parser=args.tool_call_parser,
        max_unstreamed_entries=args.max_unstreamed_entries,
        drain_timeout=args.drain_timeout,
        engine_iteration_timeout=args.engine_iteration_timeout,
        lora=LoRAServingConfig(
            modules=parse_lora_modules(args.lora_modules or []),
            allowed_roots=args.lora_allowed_roots,
            runtime_updating=args.enable_lora_runtime_updating,
        ),
    )
    return asyncio.run(serve(engine_args, config, engine))


def cmd_download(args: argparse.Namespace) -> int:
    from kvscale.worker.model.download import main as download

    return download(args.uri, args.dest, args.termination_log, check_only=args.check)


def cmd_compile(args: argparse.Namespace) -> int:
    """Build the compiled CPU forward's package for a model (model/aot_package.py); its last line
    names the package's folder (compile_behind.py reads it)."""
    from pathlib import Path

    from kvscale.worker.model.aot_package import build_for_model, default_cache_dir, private_inductor_cache

    if args.nice:
        os.nice(args.nice)

    def say(message: str) -> None:
        """Progress to stdout; if the reader has gone (a generate that finished first), the build
        goes on silently so that its package still lands in the cache."""
        try:
            print(message, flush=True)
        except OSError:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
            sys.stderr = sys.stdout

    model = resolve_model(args.model)
    cache_dir = Path(args.compile_cache_dir) if args.compile_cache_dir else default_cache_dir()
    started = time.monotonic()
    with private_inductor_cache():
        folder, built = build_for_model(
            model,
            args.dtype,
            args.block_size,
            cache_dir,
            force=args.force,
            progress=say,
            lora=args.enable_lora,
        )
    seconds = time.monotonic() - started
    say(f"{'compiled' if built else 'found'} in {seconds:.1f} s, package: {folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscale-worker", description="kvscale inference worker")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format", choices=["json", "text"], default="json", help="json: one object per line"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline and print them")
    EngineArgs.add_cli_args(gen, model_required=False)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    EngineArgs.add_cli_args(srv, model_required=False)
    srv.add_argument(
        "--host",
        default=os.environ.get("KVSCALE_HOST") or None,
        help="listen address (env KVSCALE_HOST; default: every interface, IPv4 and IPv6)",
    )
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: --model)"
    )
    srv.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` (or set KVSCALE_API_KEY)"
    )
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="waiting requests beyond this get 429 + Retry-After",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help='reads tool calls out of the output for tool_choice "auto" (default: none, auto is a 400)',
    )
    srv.add_argument(
        "--max-unstreamed-entries",
        type=int,
        default=None,
        help="a non-streamed answer's bound: prompts x n x max_tokens x (1 + logprobs) (default: "
        "8 x max_model_len, at least 2^20); past it a 400 asks for stream: true",
    )
    srv.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may run after SIGTERM"
    )
    srv.add_argument(
        "--engine-iteration-timeout",
        type=float,
        default=60.0,
        help="/health fails while one engine step runs longer than this (seconds; 0: never)",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, each selected by a request's `model` "
        "(needs --enable-lora)",
    )
    srv.add_argument(
        "--lora-allowed-roots",
        nargs="+",
        default=None,
        metavar="DIR",
        help="folders adapters may be read from (every file, symlinks resolved); runtime loads need them",
    )
    srv.add_argument(
        "--enable-lora-runtime-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, off by default)",
    )
    srv.set_defaults(func=cmd_serve)

    comp = sub.add_parser(
        "compile",
        help="build the compiled CPU forward of a model once, for every worker of it (docs/engine.md)",
    )
    comp.add_argument(
        "--model", default=None, help="a model folder (its config.json; default: the built-in model)"
    )
    comp.add_argument("--dtype", default="auto", help="the dtype served (auto: float32 on CPU)")
    comp.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    comp.add_argument(
        "--compile-cache-dir",
        default=None,
        help="default $KVSCALE_COMPILE_CACHE, else ~/.cache/kvscale/compiled",
    )
    comp.add_argument("--nice", type=int, default=0, help="run at this niceness (0-19)")
    comp.add_argument("--force", action="store_true", help="build even if a package is there")
    comp.add_argument(
        "--enable-lora",
        action="store_true",
        help="the package of a worker serving LoRA adapters (one more graph: decode steps with adapters)",
    )
    comp.set_defaults(func=cmd_compile)

    dl = sub.add_parser(
        "download",
        help="fetch a model snapshot from the Hugging Face Hub into a folder (the pods' init container)",
    )
    dl.add_argument("uri", help="hf://ORG/NAME[@REVISION]; the token is HF_TOKEN, the endpoint HF_ENDPOINT")
    dl.add_argument("--dest", required=True, help="the model folder to fill (kept: a complete one is reused)")
    dl.add_argument(
        "--termination-log",
        default="/dev/termination-log",
        help="where a failure's one-line reason goes (the kubelet's terminationMessagePath)",
    )
    dl.add_argument(
        "--check",
        action="store_true",
        help="only check, offline and read-only, that a complete snapshot is in --dest (a read-only "
        "model cache, filled once beforehand)",
    )
    dl.set_defaults(func=cmd_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
