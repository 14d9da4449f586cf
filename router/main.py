"""`kvscale-router`: the router in front of one InferenceDeployment's workers, or of several
models' pools of workers behind one endpoint (docs/router.md).

    kvscale-router --service NAME [--namespace NS] [--port-name http] [--port 8000] ...
    kvscale-router --endpoints http://10.0.0.1:8000,http://10.0.0.2:8000 ...   # static: tests, bench
    kvscale-router --service NAME --scale-deployment NAME ...   # scale from zero (docs/router.md)
    kvscale-router --pool llama=llama,scale=llama,adapters=sql|chat --pool qwen=qwen ...  # per model

With --service, the endpoints are the Service's EndpointSlices (ready, not terminating), watched
through the API (in-cluster credentials, else KUBECONFIG / ~/.kube/config); the namespace defaults
to the pod's own. SIGTERM/SIGINT: stop listening, let requests in flight finish (up to
--shutdown-timeout), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from kvscale.router.auth import KeyFile
from kvscale.router.endpoints import (
    READ_GRACE_S,
    WATCH_TIMEOUT_S,
    SliceWatcher,
    StaticEndpoints,
)
from kvscale.router.kv_events import KVEventsSource
from kvscale.router.picker import PickerConfig, Weights
from kvscale.router.pool import MAX_POOLS, PoolParts, PoolSpec, parse_pool_specs
from kvscale.router.prefix_index import DEFAULT_CAPACITY, PrefixIndex
from kvscale.router.server import Router, RouterConfig, build_app
from kvscale.router.state import POLICIES, RouterState
from kvscale.router.tokenizer import FROM_WORKERS, PromptTokenizer
from kvscale.router.wake import Waker, scale_up_from_zero

logger = logging.getLogger("kvscale.router")
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscale-router", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--service", help="the workers' Service (its EndpointSlices are watched)")
    src.add_argument("--endpoints", help="comma-separated worker URLs (static mode)")
    src.add_argument(
        "--pool",
        action="append",
        metavar="MODEL=SOURCE[,scale=DEPLOYMENT][,adapters=A|B][,keys=FILE]",
        help=f"one model's workers (repeatable, at most {MAX_POOLS}): SOURCE is a Service in "
        "--namespace, or worker URLs joined with + (static); scale=: its Deployment, scaled from "
        "zero; adapters=: LoRA adapters it serves; keys=: its workers' API keys (a file), which a "
        "client must present to reach it. Each request goes to its model's pool; an unknown model "
        "gets 404",
    )
    p.add_argument("--namespace", default=None, help="the Service's namespace (default: this pod's)")
    p.add_argument("--port-name", default=None, help="the EndpointSlice port to use (default: its first)")
    p.add_argument(
        "--host",
        default=os.environ.get("KVSCALE_HOST") or None,
        help="listen address (env KVSCALE_HOST; default: every interface, IPv4 and IPv6)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=POLICIES, default="kv-prefix", help="round-robin: the baseline")
    p.add_argument("--prefix-weight", type=float, default=3.0)
    p.add_argument("--kv-weight", type=float, default=2.0)
    p.add_argument("--queue-weight", type=float, default=2.0)
    p.add_argument(
        "--lora-weight",
        type=float,
        default=20.0,
        help="adapter affinity: resident 1, an empty slot 0.75, an idle adapter's slot 0.5 (keep a "
        "quarter of it over kv + queue weights)",
    )
    p.add_argument("--load-factor", type=float, default=1.25, help="c of the bounded-load guard (>= 1)")
    p.add_argument(
        "--max-waiting", type=int, default=32, help="an endpoint with this many waiting takes no more"
    )
    p.add_argument("--max-kv-usage", type=float, default=0.95)
    p.add_argument(
        "--prefill-guard",
        type=float,
        default=None,
        metavar="FACTOR",
        help="queue-aware: an endpoint whose queued prefill tokens plus this request's uncached ones "
        "exceed FACTOR x the least endpoint's (+ --prefill-slack) takes nothing (needs the precise "
        "index; default: off)",
    )
    p.add_argument("--prefill-slack", type=int, default=256, help="tokens of the prefill guard's slack")
    p.add_argument(
        "--expose-picks",
        action="store_true",
        help="serve POST /kvscale/pick/v1/(chat/)completions: the endpoint a request would go to, "
        "sending nothing (benchmarks; it tells clients the workers' addresses)",
    )
    p.add_argument("--block-chars", type=int, default=64, help="characters per hashed prefix block")
    p.add_argument("--max-blocks", type=int, default=256, help="leading blocks hashed per request")
    p.add_argument(
        "--index-capacity", type=int, default=DEFAULT_CAPACITY, help="blocks per endpoint (default)"
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="the workers' KV event stream port (their --kv-events-config endpoint): subscribe to "
        "every endpoint's and score prefixes by the precise index (default: off, approximate only)",
    )
    p.add_argument(
        "--kv-events-replay-port", type=int, default=5558, help="the workers' KV event replay port"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the model's tokenizer, so that text and chat prompts get the workers' token ids for "
        "the precise index: a folder of its files, or 'workers': fetched from a ready worker "
        "(without it, only prompts of token ids match precisely)",
    )
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument(
        "--max-queued-per-client",
        type=int,
        default=None,
        help="places in the queue one client (API key, else peer address) may hold "
        "(default: a quarter of --max-queued)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="client API keys, one per line (a mounted Secret; re-read when it changes): "
        "a request without one of them gets 401",
    )
    p.add_argument(
        "--upstream-api-key-file",
        default=None,
        help="the workers' API key (its first line): replaces the client's Authorization on the "
        "way to a worker (default: the client's header goes through as it came)",
    )
    p.add_argument(
        "--queue-timeout", type=float, default=60.0, help="seconds a request may wait in the router"
    )
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may stay silent (before its answer's headers, or between two chunks)",
    )
    p.add_argument(
        "--watch-timeout",
        type=int,
        default=WATCH_TIMEOUT_S,
        help="seconds the API server keeps each EndpointSlice watch open (timeoutSeconds); the "
        f"client gives up on a silent one {READ_GRACE_S:g} s later and lists again",
    )
    p.add_argument("--scrape-interval", type=float, default=0.25)
    p.add_argument("--scrape-timeout", type=float, default=1.0)
    p.add_argument("--scrape-concurrency", type=int, default=16)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument(
        "--scale-deployment",
        default=None,
        help="the workers' Deployment: at zero ready workers a request asks it for one replica "
        "(its scale subresource, in --namespace); with --pool, each pool's scale= instead",
    )
    p.add_argument(
        "--heartbeat", type=float, default=5.0, help="seconds between SSE comments to a waiting stream"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    return p


def _namespace(flag: str | None) -> str:
    if flag:
        return flag
    if SA_NAMESPACE.is_file():
        return SA_NAMESPACE.read_text().strip()
    return os.environ.get("POD_NAMESPACE", "default")


def pool_specs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[PoolSpec]:
    """The --pool values, checked (parser.error, exit 2, on anything wrong), with the flags that
    cannot mean one thing for several pools refused."""
    if not args.pool:
        return []
    try:
        specs = parse_pool_specs(args.pool)
    except ValueError as e:
        parser.error(str(e))
    if args.scale_deployment:
        parser.error("--scale-deployment names one Deployment: with --pool, give each pool's scale=")
    if args.tokenizer and args.tokenizer != FROM_WORKERS and len(specs) > 1:
        parser.error("--tokenizer PATH is one model's: with several pools, use --tokenizer workers")
    return specs


def build_router(args: argparse.Namespace, specs: list[PoolSpec] | None = None) -> Router:
    """The router the flags describe; `specs`: the --pool values (pool_specs), else parsed here."""
    if specs is None:
        specs = pool_specs(build_parser(), args)
    picker = PickerConfig(
        weights=Weights(args.prefix_weight, args.kv_weight, args.queue_weight, args.lora_weight),
        load_factor=args.load_factor,
        max_waiting=args.max_waiting,
        max_kv_usage=args.max_kv_usage,
        prefill_factor=args.prefill_guard,
        prefill_slack=args.prefill_slack,
    )

    def state() -> RouterState:
        return RouterState(picker, PrefixIndex(args.index_capacity), args.policy)

    def slices(service: str) -> SliceWatcher:
        return SliceWatcher(
            service, _namespace(args.namespace), args.port_name, watch_timeout_s=args.watch_timeout
        )

    config = RouterConfig(
        block_chars=args.block_chars,
        max_blocks=args.max_blocks,
        max_body_bytes=args.max_body_bytes,
        max_retries=args.max_retries,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        queue_timeout_s=args.queue_timeout,
        max_queued=args.max_queued,
        max_queued_per_client=args.max_queued_per_client,
        scrape_interval_s=args.scrape_interval,
        scrape_timeout_s=args.scrape_timeout,
        scrape_concurrency=args.scrape_concurrency,
        heartbeat_s=args.heartbeat,
        expose_picks=args.expose_picks,
    )
    apps = None

    def waker(deployment: str | None) -> Waker | None:
        nonlocal apps
        if deployment is None:
            return None
        apps = apps or _apps_api()
        return Waker(scale_up_from_zero(apps, deployment, _namespace(args.namespace)))

    api_keys = KeyFile(args.api_key_file) if args.api_key_file else None
    upstream = KeyFile(args.upstream_api_key_file) if args.upstream_api_key_file else None
    kv_events = None
    if args.kv_events_port is not None:
        kv_events = KVEventsSource(args.kv_events_port, args.kv_events_replay_port)
    from_workers = args.tokenizer == FROM_WORKERS
    tokenizer = PromptTokenizer(args.tokenizer) if args.tokenizer and not from_workers else None
    if specs:
        pools = [
            PoolParts(
                s.model,
                state(),
                StaticEndpoints(s.urls) if s.urls else slices(s.service or ""),
                waker(s.scale),
                adapters=s.adapters,
                tokenizer=tokenizer,  # a folder: only with one pool (pool_specs)
                api_keys=KeyFile(s.keys) if s.keys else None,
            )
            for s in specs
        ]
        return Router(
            config=config,
            api_keys=api_keys,
            upstream_key=upstream,
            kv_events=kv_events,
            tokenizer_from_workers=from_workers,
            pools=pools,
        )
    source = StaticEndpoints(args.endpoints.split(",")) if args.endpoints else slices(args.service)
    return Router(
        state(),
        source,
        config,
        waker(args.scale_deployment),
        api_keys=api_keys,
        upstream_key=upstream,
        kv_events=kv_events,
        tokenizer=tokenizer,
        tokenizer_from_workers=from_workers,
    )


def _apps_api():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


async def serve(args: argparse.Namespace, specs: list[PoolSpec] | None = None) -> int:
    router = build_router(args, specs)
    app = build_app(router)
    # handler_cancellation: a client that disconnects cancels its handler, which leaves the queue
    # or closes its worker connection (the worker aborts the request).
    # auto_decompress=False, as the worker: bodies go to the workers as they came (a compressed one
    # is not JSON, a clear 400), and aiohttp 3.14 can hang on a deflate body broken at its end.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=args.shutdown_timeout,
        auto_decompress=False,
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.info("listening", extra={"host": args.host, "port": args.port, "policy": args.policy})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping")
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvscale.common.json_logging import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    specs = pool_specs(parser, args)  # before anything starts: a bad --pool exits 2
    configure_logging(args.log_level, args.log_format)
    return asyncio.run(serve(args, specs))


if __name__ == "__main__":
    sys.exit(main())
