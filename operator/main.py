"""`kvscale-operator`: run the operator, or print its CRD / reference.

    kvscale-operator run [--namespace NS] [--lease-name NAME] [--identity ID] [--health-port 8080]
    kvscale-operator crd [--markdown]

`run` waits to hold the Lease (standby replicas wait here), then runs the kopf handlers
cluster-wide until SIGTERM (exit 0, the Lease handed back) or until the Lease is lost (exit 1, so
the pod restarts as a standby). Credentials: in-cluster, else KUBECONFIG / ~/.kube/config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("kvscale.operator")


def _health_server(host: str, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path in ("/healthz", "/readyz")
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"not found")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="health").start()


async def _lead(lock, renew_s: float) -> int:
    import kopf

    import kvscale.operator.autoscaler  # registers the autoscaler's event handler
    import kvscale.operator.handlers  # noqa: F401 (registers the handlers)

    stop = asyncio.Event()
    lost = False

    async def keep_lease() -> None:
        nonlocal lost
        while not stop.is_set():
            await asyncio.sleep(renew_s)
            try:
                held = await asyncio.to_thread(lock.try_acquire)
            except Exception:
                logger.exception("lease renewal failed")
                held = False
            if not held:
                lost = True
                logger.error("lost the lease; stopping")
                stop.set()

    keeper = asyncio.create_task(keep_lease())
    try:
        # standalone: our Lease replaces kopf's peering; kopf stops on SIGTERM or on `stop`.
        await kopf.operator(clusterwide=True, standalone=True, stop_flag=stop)
    finally:
        stop.set()
        keeper.cancel()
    if lost:
        return 1
    lock.release()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from kvscale.operator.handlers import api
    from kvscale.operator.leader import LeaseLock

    if args.health_port:
        _health_server(args.health_host, args.health_port)
    lock = LeaseLock(api(), args.namespace, args.lease_name, args.identity, duration_s=args.lease_seconds)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    logger.info(
        "waiting for the lease",
        extra={"lease": f"{args.namespace}/{args.lease_name}", "identity": args.identity},
    )
    while not lock.try_acquire():
        if stopping.wait(2.0):
            return 0  # stopped while standing by
    logger.info("leading", extra={"identity": args.identity})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on kopf handles the signals
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if stopping.is_set():
        lock.release()
        return 0
    return asyncio.run(_lead(lock, renew_s=args.lease_seconds / 3))


def cmd_crd(args: argparse.Namespace) -> int:
    from kvscale.operator.crd import crd_yaml, reference_markdown

    sys.stdout.write(reference_markdown() if args.markdown else crd_yaml())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvscale-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (leader-elected)")
    run.add_argument(
        "--namespace", default=os.environ.get("POD_NAMESPACE", "kvscale-system"), help="where the Lease lives"
    )
    run.add_argument("--lease-name", default="kvscale-operator")
    run.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname())
    run.add_argument(
        "--lease-seconds", type=int, default=15, help="a dead leader is replaced after this long"
    )
    run.add_argument("--health-port", type=int, default=8080, help="/healthz and /readyz (0: off)")
    run.add_argument(
        "--health-host", default=os.environ.get("KVSCALE_HOST", "0.0.0.0"), help="(env KVSCALE_HOST)"
    )
    run.set_defaults(func=cmd_run)
    crd = sub.add_parser(
        "crd", help="print the CustomResourceDefinition (or, with --markdown, its reference)"
    )
    crd.add_argument("--markdown", action="store_true")
    crd.set_defaults(func=cmd_crd)
    args = parser.parse_args(argv)

    from kvscale.worker.server.json_logging import configure_logging

    configure_logging(args.log_level, args.log_format)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
