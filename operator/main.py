"""`kvscale-operator`: run the operator, or print its CRD / reference.

    kvscale-operator run [--namespace NS] [--lease-name NAME] [--identity ID] [--health-port 8080]
                         [--lease-duration 15] [--renew-deadline 10] [--retry-period 2]
                         [--liveness-timeout 30] [--watch-namespace NS ...]
    kvscale-operator crd [--markdown]

`run` waits to hold the Lease (standby replicas wait here), then runs the kopf handlers
cluster-wide (or, with --watch-namespace, in those namespaces only) until SIGTERM (exit 0, the
Lease handed back) or until it could not renew the Lease within the renew deadline (it stops
writing at once, then exits 1, so the pod restarts as a standby). Credentials: in-cluster, else
KUBECONFIG / ~/.kube/config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import signal
import socket
import sys
import threading
import time

from kvscale.operator.health import DEFAULT_STALL_S, Health, heartbeat, serve, watch_task
from kvscale.operator.settings import Settings

logger = logging.getLogger("kvscale.operator")
EXIT_GRACE_S = 30.0  # after losing the lease, how long kopf may take to stop


# A namespace's name: an RFC 1123 label.
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def watch_namespaces(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    """The namespaces to watch: --watch-namespace (repeated, or comma-separated), else
    KVSCALE_WATCH_NAMESPACES (comma-separated); none: every namespace. Raises ValueError on a
    name that cannot be a namespace (kopf would take it as a glob pattern)."""
    given = flags if flags else [env or ""]
    names = tuple(dict.fromkeys(n.strip() for item in given for n in item.split(",") if n.strip()))
    bad = [n for n in names if not NAMESPACE_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"not a namespace name: {', '.join(bad)}")
    return names


def kopf_scope(namespaces: tuple[str, ...]) -> dict:
    """kopf.operator's arguments for the scope: every namespace, or exactly the given ones."""
    return {"namespaces": list(namespaces)} if namespaces else {"clusterwide": True}


def _namespaced_settings(settings, **_) -> None:
    """A namespaced install has no cluster-wide rights: kopf must not list or watch Namespaces
    or CRDs (cluster-scoped). It then serves exactly the given namespaces and the resources
    found at startup (API discovery, which every authenticated user may read)."""
    settings.scanning.disabled = True


def _env_number(name: str, kind: type, default: float) -> float:
    value = os.environ.get(name)
    return kind(value) if value else default


def _fenced_login(fence):
    """kopf's login, with kopf's own requests fenced: its status bookkeeping and events are
    writes too, and a leader past its renew deadline must make none."""

    async def login(**kwargs):
        import aiohttp
        import kopf

        from kvscale.operator.kube.leader import fence_trace

        info = kopf.login_via_client(**kwargs)  # in-cluster, else the kubeconfig, as kopf would
        if info is None:
            raise kopf.LoginError("no credentials: the Kubernetes client is not installed")
        # As kopf builds its own session (auth.APIContext; the credentials are in the headers),
        # plus the fence.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
            headers=info.as_http_headers(),
            trust_env=info.trust_env,
            trace_configs=[fence_trace(fence)],
        )
        return kopf.AiohttpSession(
            aiohttp_session=session,
            server=info.server,
            default_namespace=info.default_namespace,
            priority=info.priority,
        )

    return login


def _timeouts(settings, **_) -> None:
    """No API call of kopf's without a timeout (kopf's defaults: none to connect, none on a watch)."""
    settings.networking.request_timeout = settings.networking.request_timeout or 60
    settings.networking.connect_timeout = settings.networking.connect_timeout or 10
    settings.watching.connect_timeout = settings.watching.connect_timeout or 10
    # A watch lives server_timeout; one that outlives it by a minute is dead (kopf's own
    # inactivity_timeout also restarts a stream that sent nothing, not even a bookmark).
    settings.watching.client_timeout = (settings.watching.server_timeout or 300) + 60


async def _lead(
    lock, fence, registry, scaler, namespaces: tuple[str, ...] = (), health: Health | None = None
) -> int:
    """Run kopf, with the handlers of `registry` (handlers.Handlers.register), while the lease is ours
    (leader.keep_renewing); when it is lost, stop kopf and the autoscaler's tasks (`scaler`: their
    writes are refused already, by the fence) and exit 1. A heartbeat on this loop, and kopf's
    task, tell /healthz whether the loop still runs."""
    import kopf

    from kvscale.operator.kube.leader import RenewalThread, keep_renewing

    health = health or Health()
    health.may_act = fence.may_act
    health.set_role("leading")
    beating = asyncio.create_task(heartbeat(health), name="heartbeat")

    stop = asyncio.Event()
    lost = False
    # The Lease's calls (renewals, the release) on a thread of their own: kopf's handlers, the
    # resync and the autoscaler fill Python's default pool with calls of up to 30 s.
    renewal_thread = RenewalThread()

    async def guard() -> None:
        nonlocal lost
        lost = await keep_renewing(lock, fence, stop, renewal_thread)
        if lost:
            logger.error("lost the lease; stopping", extra={"holder": lock.holder()})
            health.set_role("stopping")
            scaler.stop_all()
            stop.set()
            # kopf stops within seconds; should it hang, a fenced process must not linger
            # (it would never stand by again): exit regardless.
            timer = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
            timer.daemon = True
            timer.start()

    kopf.on.login(registry=registry)(_fenced_login(fence))
    kopf.on.startup(registry=registry)(_timeouts)
    if namespaces:
        kopf.on.startup(registry=registry)(_namespaced_settings)
    keeper = asyncio.create_task(guard())
    try:
        # standalone: our Lease replaces kopf's peering; kopf stops on SIGTERM or on `stop`.
        running = asyncio.create_task(
            kopf.operator(registry=registry, standalone=True, stop_flag=stop, **kopf_scope(namespaces)),
            name="kopf",
        )
        watch_task(health, running, "kopf's main task")
        await running
    finally:
        health.set_role("stopping")
        stop.set()
        keeper.cancel()
        beating.cancel()
        scaler.stop_all()
        if not lost and not fence.may_act():  # kopf stopped first (e.g. on a refused write)
            logger.error("lost the lease: the renew deadline passed; stopping")
    try:
        if lost or not fence.may_act():
            return 1
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(renewal_thread, lock.release, fence.timings.retry_period_s)
        return 0
    finally:
        renewal_thread.shutdown(wait=False)


def build(settings: Settings, api) -> tuple:
    """The operator's parts over one Kubernetes ApiClient: (the kopf registry with every
    handler, the reconciler, the autoscaler)."""
    import kopf

    from kvscale.operator.adapters.sync import AdapterSync
    from kvscale.operator.autoscaler.scaler import Scaler
    from kvscale.operator.handlers import Handlers
    from kvscale.operator.kube.client import Kube
    from kvscale.operator.reconcile.endpoint_sync import EndpointReconciler
    from kvscale.operator.reconcile.reconciler import Reconciler

    kube = Kube(api, settings.watch_namespaces)
    reconciler, scaler = Reconciler(kube, settings), Scaler(kube)
    adapters = AdapterSync(kube, scaler.pods, scaler.owners)
    scaler.also_stop.append(adapters.stop_all)
    handlers = Handlers(reconciler, scaler, adapters, EndpointReconciler(kube, settings))
    return handlers.register(kopf.OperatorRegistry()), reconciler, scaler


def cmd_run(args: argparse.Namespace) -> int:
    from kubernetes import client

    from kvscale.operator.kube.client import load_api_client
    from kvscale.operator.kube.leader import (
        JITTER,
        Fence,
        LeaseLock,
        Timings,
        fence_api_client,
        lease_api_client,
    )

    timings = Timings(args.lease_duration, args.renew_deadline, args.retry_period)
    settings = Settings.from_env(watch_namespaces=args.watch_namespaces)
    health = Health(args.liveness_timeout)
    if args.health_port:
        serve(health, args.health_host, args.health_port)
    # Every request of this client (the reconciler's, the autoscaler's) goes through the fence,
    # with a timeout; the Lease has a client of its own, outside the fence, with its own pool
    # and timeouts below the renew deadline (no re-sends inside urllib3 either, so none of its
    # writes leaves after its attempt's deadline).
    api = load_api_client()
    fence = Fence(timings)
    fence_api_client(api, fence)
    # Built (the handlers registered) before standing by: a standby that wins starts at once.
    registry, _, scaler = build(settings, api)
    coordination = client.CoordinationV1Api(lease_api_client(api.configuration, timings))
    lock = LeaseLock(coordination, args.namespace, args.lease_name, args.identity, timings)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    logger.info(
        "waiting for the lease",
        extra={"lease": f"{args.namespace}/{args.lease_name}", "identity": args.identity},
    )
    while True:
        health.beat()  # a standby's heartbeat: this loop (an attempt ends by its deadline)
        try:
            started = lock.try_acquire_or_renew(time.monotonic() + timings.renew_deadline_s)
        except Exception as e:
            logger.warning("reading the lease failed: %s", e)
            started = None
        else:
            if started is None:
                health.set_role("standby")
        health.beat()
        if started is not None:
            break
        # client-go's jitter (a retry period x [1, 2.2)), so that standbys do not poll in step
        if stopping.wait(random.uniform(1, 1 + JITTER) * timings.retry_period_s):
            return 0  # stopped while standing by
    fence.renewed(started)
    logger.info(
        "leading",
        extra={"identity": args.identity, "namespaces": list(args.watch_namespaces) or "all"},
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on kopf handles the signals
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if stopping.is_set():
        lock.release(timings.retry_period_s)
        return 0
    return asyncio.run(_lead(lock, fence, registry, scaler, args.watch_namespaces, health))


def cmd_crd(args: argparse.Namespace) -> int:
    from kvscale.operator.api.crd import crd_yaml, reference_markdown

    if args.markdown:
        sys.stdout.write(reference_markdown(args.endpoint))
    else:
        sys.stdout.write(crd_yaml(args.endpoint))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscale-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("KVSCALE_LOG_LEVEL", "INFO"), help="(env KVSCALE_LOG_LEVEL)"
    )
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (leader-elected)")
    run.add_argument(
        "--namespace", default=os.environ.get("POD_NAMESPACE", "kvscale-system"), help="where the Lease lives"
    )
    run.add_argument("--lease-name", default="kvscale-operator")
    run.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname())
    run.add_argument(
        "--lease-duration",
        type=int,
        default=_env_number("KVSCALE_LEASE_DURATION", int, 15),
        help="seconds: a leader that stopped renewing is replaced after this long "
        "(env KVSCALE_LEASE_DURATION)",
    )
    run.add_argument(
        "--renew-deadline",
        type=float,
        default=_env_number("KVSCALE_RENEW_DEADLINE", float, 10.0),
        help="seconds: a leader that could not renew for this long stops acting; below --lease-duration "
        "(env KVSCALE_RENEW_DEADLINE)",
    )
    run.add_argument(
        "--retry-period",
        type=float,
        default=_env_number("KVSCALE_RETRY_PERIOD", float, 2.0),
        help="seconds between renewals, and between a standby's tries (env KVSCALE_RETRY_PERIOD)",
    )
    run.add_argument("--health-port", type=int, default=8080, help="/healthz, /readyz and /metrics (0: off)")
    run.add_argument(
        "--liveness-timeout",
        type=float,
        default=_env_number("KVSCALE_LIVENESS_TIMEOUT", float, DEFAULT_STALL_S),
        help="seconds: /healthz fails when the operator's loop has not ticked for this long; above "
        "--renew-deadline + 1.2 x --retry-period, a standby's longest wait (env KVSCALE_LIVENESS_TIMEOUT)",
    )
    run.add_argument(
        "--health-host",
        default=os.environ.get("KVSCALE_HOST") or None,
        help="listen address (env KVSCALE_HOST; default: every interface, IPv4 and IPv6)",
    )
    run.add_argument(
        "--watch-namespace",
        action="append",
        dest="watch_namespaces",
        metavar="NS",
        help="serve InferenceDeployments in this namespace only (repeat, or comma-separate, for "
        "several; the namespaced install, manifests/namespaced/); default: every namespace "
        "(env KVSCALE_WATCH_NAMESPACES, comma-separated)",
    )
    run.set_defaults(func=cmd_run)
    crd = sub.add_parser(
        "crd", help="print the CustomResourceDefinition (or, with --markdown, its reference)"
    )
    crd.add_argument("--markdown", action="store_true")
    crd.add_argument("--endpoint", action="store_true", help="the InferenceEndpoint's")
    crd.set_defaults(func=cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from kvscale.operator.kube.leader import JITTER, Timings

        try:
            timings = Timings(args.lease_duration, args.renew_deadline, args.retry_period)
            if args.liveness_timeout <= timings.renew_deadline_s + JITTER * timings.retry_period_s:
                raise ValueError(
                    "--liveness-timeout must exceed --renew-deadline + 1.2 x --retry-period "
                    "(a standby beats once per attempt and wait)"
                )
            args.watch_namespaces = watch_namespaces(
                args.watch_namespaces, os.environ.get("KVSCALE_WATCH_NAMESPACES")
            )
        except ValueError as e:
            parser.error(str(e))

    from kvscale.common.json_logging import configure_logging

    configure_logging(args.log_level, args.log_format)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
