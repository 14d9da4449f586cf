"""Read safetensors checkpoints through memory maps, in parallel, straight into the parameters.

Each file is mapped (private, copy-on-write: never written, so nothing is copied); each tensor is a
view of its bytes in the map, and the caller's `consume` copies it into its parameter, casting on
the way where the dtypes differ. So a byte goes from the page cache into the parameter once, with no
staging buffer, and the page faults of several threads keep several reads in flight on a cold
cache. Before its copy a tensor's range is announced (MADV_WILLNEED: the kernel reads it ahead);
after it, dropped from this process (MADV_DONTNEED: the page cache keeps it), so the mapped pages
never add a second copy of the weights to the worker's memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Threads copying tensors. Copies release the GIL; more threads keep more reads in flight on a cold
# page cache (docs/benchmarks.md, "Loading a checkpoint").
LOAD_THREADS = 8
PAGE = mmap.PAGESIZE


def _advise(mm: mmap.mmap, start: int, end: int, advice: int) -> None:
    begin = start - start % PAGE
    length = min(len(mm), end) - begin
    if length > 0:
        with contextlib.suppress(OSError, ValueError):  # advice only
            mm.madvise(advice, begin, length)


def read_mapped(
    files: list[Path],
    headers: list[tuple[int, dict]],
    dtypes: dict[str, torch.dtype],
    consume: Callable[[str, torch.Tensor], object],
    threads: int = LOAD_THREADS,
    progress: Callable[[int, int], None] | None = None,
) -> list:
    """consume(name, tensor) for every tensor of the files (headers: read_safetensors_header of each),
    `threads` at a time; each tensor is a view of the file's map, valid during the call only.
    progress(done_bytes, total_bytes) after each. Returns consume's results, file by file in offset
    order."""
    maps, tasks = [], []
    try:
        for path, (data_start, header) in zip(files, headers, strict=True):
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            maps.append(mm)
            whole = torch.frombuffer(mm, dtype=torch.uint8)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = (data_start + o for o in info["data_offsets"])
                if end > len(mm):
                    raise ValueError(f"{path.name}: tensor {name!r} is truncated")
                tasks.append((mm, whole, name, begin, end, dtypes[info["dtype"]], info["shape"]))
        total = sum(end - begin for _, _, _, begin, end, _, _ in tasks)

        def run(task) -> object:
            mm, whole, name, begin, end, dtype, shape = task
            _advise(mm, begin, end, mmap.MADV_WILLNEED)
            raw = whole[begin:end]
            try:
                tensor = raw.view(dtype).view(shape)
            except RuntimeError:  # an offset not aligned to the dtype: copy the bytes once
                tensor = raw.clone().view(dtype).view(shape)
            try:
                return consume(name, tensor)
            finally:
                del raw, tensor
                _advise(mm, begin, end, mmap.MADV_DONTNEED)

        results: list = [None] * len(tasks)
        done = 0
        with ThreadPoolExecutor(max(1, min(threads, len(tasks))), thread_name_prefix="kvscale-load") as pool:
            futures = {pool.submit(run, task): i for i, task in enumerate(tasks)}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                done += tasks[i][4] - tasks[i][3]
                if progress is not None:
                    progress(done, total)
        return results
    finally:
        tasks.clear()
        for mm in maps:
            with contextlib.suppress(BufferError):  # a view still alive (an error's traceback): GC closes it
                mm.close()


MIN_REPORTED_BYTES = 256 << 20  # smaller checkpoints load in well under a second: no progress lines


class LoadProgress:
    """Logs every 10% of the bytes, with the rate so far."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.next = 0.1

    def __call__(self, done: int, total: int) -> None:
        if total >= MIN_REPORTED_BYTES and done >= self.next * total:
            elapsed = max(time.monotonic() - self.started, 1e-9)
            logger.info(
                "%s: %d%% (%.2f of %.2f GB, %.2f GB/s)",
                self.label, 100 * done // total, done / 1e9, total / 1e9, done / 1e9 / elapsed,
            )  # fmt: skip
            self.next = (int(10 * done / total) + 1) / 10
