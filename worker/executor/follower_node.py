"""A node other than node 0 of a multi-node group (--nnodes M --node-rank R > 0): it runs its ranks
and serves only the kubelet's probes on --port, so follower pods have working liveness/readiness.

/health: 200 while every local rank is alive, 500 once one has died (then the process exits 1).
/ready: 200 once every local rank has joined the group and loaded its shard, 503 before.
It exits 0 when its ranks stop because rank 0 shut down, and on SIGTERM (stopping its ranks).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from kvscale.worker.executor.launcher import RankProcesses, group_failure, local_ranks, on_group_failure

logger = logging.getLogger(__name__)


def build_app(ranks: RankProcesses) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        if group_failure() is not None or not ranks.alive():
            return web.json_response({"status": "rank failed"}, status=500)
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        if group_failure() is None and ranks.alive() and ranks.all_ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "loading"}, status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app


async def serve_follower_node(args, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    failed, stop = asyncio.Event(), asyncio.Event()
    on_group_failure(lambda reason: loop.call_soon_threadsafe(failed.set))
    ranks = RankProcesses(args, local_ranks(args.tensor_parallel_size, args.nnodes, args.node_rank))
    ranks.start()
    runner = web.AppRunner(build_app(ranks), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("follower node listening", extra={"node_rank": args.node_rank, "ranks": ranks.ranks})
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    finished = loop.run_in_executor(None, ranks.finished.wait)
    waits = {asyncio.ensure_future(e.wait()) for e in (failed, stop)} | {finished}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if failed.is_set():
        await asyncio.sleep(1.0)  # /health answers 500 meanwhile
        code = 1
    else:
        code = 0
    ranks.stop(timeout=0 if stop.is_set() else 10.0)
    await runner.cleanup()
    logger.info("follower node stopped", extra={"exit_code": code})
    return code
