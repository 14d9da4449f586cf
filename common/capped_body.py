"""Reading a peer's HTTP body with a size cap: what the autoscaler and the router scrape from pods.

A worker's /metrics is ~20 KiB. Anything a pod answers is untrusted (a tenant can label a pod of
its own as a worker, a bug can loop), so no scrape reads more than its cap: the body is read in
chunks and the connection dropped as soon as it passes the cap. Sessions that use this must not
decompress (`auto_decompress=False`): a small gzip body can inflate past any cap before a chunk
reaches us.
"""

from __future__ import annotations

import aiohttp

CHUNK = 64 << 10


class TooLarge(Exception):
    pass


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, read in chunks; TooLarge as soon as it passes `max_bytes` (the rest is never
    read: the connection is dropped)."""
    if response.content_length is not None and response.content_length > max_bytes:
        raise TooLarge(f"Content-Length {response.content_length}")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
