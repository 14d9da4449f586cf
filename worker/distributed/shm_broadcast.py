"""A ring buffer in shared memory: rank 0 writes each step's inputs once, every rank of its host reads
them (vLLM's shm broadcast idea), instead of a pickled object over gloo sockets per rank.

- The ring: NUM_SLOTS slots of SLOT_BYTES in one memfd (memfd_create), mapped by the writer and by
  each reader. A message is pickled once; one larger than a slot goes as consecutive parts, each
  slot freed as soon as every reader has copied it, so any size passes through a small ring.
- The events: two eventfds per reader, `ready` (slots written, the writer adds 1 per slot) and
  `free` (slots the reader is done with). Both sides sleep in poll(2), never spin: on a small CPU
  host a spinning follower would take the cores the forward needs. An eventfd write/read is a
  syscall, so the slot's bytes are ordered before the event that announces them.
- Nothing has a name: no /dev/shm segment, no sem.* file. The memfd and eventfds travel to the ranks
  as file descriptors at spawn time (multiprocessing's DupFd, as a Pipe's do), so a kill -9 of any
  process at any moment leaves nothing behind, and no resource_tracker is involved (it would warn
  about, or unlink, segments that attaching processes register).
- A dead peer is noticed, not waited for: readers poll rank 0's pidfd beside `ready` (a follower
  whose rank 0 died gets PeerGone, even without PR_SET_PDEATHSIG), the writer polls the readers'
  pidfds when a reader's ring is full.

Linux only (memfd, eventfd, pidfd); elsewhere supported() is False and the ranks use gloo.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import struct
import sys
from multiprocessing import reduction
from typing import Any

SLOT_BYTES = 256 * 1024  # a decode step of a few hundred sequences fits one slot
NUM_SLOTS = 8
_HEADER = struct.Struct("<II")  # this part's length, 1 if another part of the message follows


class PeerGone(RuntimeError):
    """The other end of the ring exited (rank 0 for a reader, a reader for the writer)."""


def supported() -> bool:
    return sys.platform.startswith("linux") and all(
        hasattr(os, f) for f in ("memfd_create", "eventfd", "pidfd_open")
    )


def _eventfd(initial: int = 0) -> int:
    # Non-blocking: the sides block in poll(2), which also watches the peers' pidfds.
    return os.eventfd(initial, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class ShmRingWriter:
    """Rank 0's end. handles[i] goes to reader i as a Process argument (spawn)."""

    def __init__(self, num_readers: int, slot_bytes: int = SLOT_BYTES, num_slots: int = NUM_SLOTS) -> None:
        if slot_bytes <= _HEADER.size or num_slots < 1 or num_readers < 1:
            raise ValueError("a ring needs readers, slots, and room for a header in each slot")
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self._mem_fd = os.memfd_create("kvscale-step-ring", os.MFD_CLOEXEC)
        os.ftruncate(self._mem_fd, slot_bytes * num_slots)
        self._mem = mmap.mmap(self._mem_fd, slot_bytes * num_slots)
        self._ready = [_eventfd() for _ in range(num_readers)]
        self._free = [_eventfd() for _ in range(num_readers)]
        self._credits = [num_slots] * num_readers  # slots each reader has room for
        self._reader_pidfds: list[int] = []
        self._next = 0
        self.sent = 0  # messages written (tests check the ring carried the steps)
        self.handles = [
            ShmRingHandle(self._mem_fd, self._ready[i], self._free[i], slot_bytes, num_slots, os.getpid())
            for i in range(num_readers)
        ]

    def watch(self, pids: list[int]) -> None:
        """The readers' processes: a full ring whose reader has exited raises PeerGone, not waits."""
        self._reader_pidfds = [os.pidfd_open(pid) for pid in pids]

    def write(self, obj: Any) -> None:
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        room = self.slot_bytes - _HEADER.size
        for start in range(0, len(data), room):
            part = data[start : start + room]
            self._wait_for_room()
            offset = self._next * self.slot_bytes
            _HEADER.pack_into(self._mem, offset, len(part), start + room < len(data))
            self._mem[offset + _HEADER.size : offset + _HEADER.size + len(part)] = part
            self._next = (self._next + 1) % self.num_slots
            for i, fd in enumerate(self._ready):
                self._credits[i] -= 1
                os.eventfd_write(fd, 1)
        self.sent += 1

    def _wait_for_room(self) -> None:
        """Until every reader has copied out the slot about to be overwritten."""
        for i, fd in enumerate(self._free):
            while self._credits[i] == 0:
                try:
                    self._credits[i] += os.eventfd_read(fd)  # all the slots freed since, at once
                except BlockingIOError:
                    if _poll(fd, self._reader_pidfds) != fd:
                        raise PeerGone("a step reader exited") from None

    def close(self) -> None:
        self._mem.close()
        for fd in [self._mem_fd, *self._ready, *self._free, *self._reader_pidfds]:
            os.close(fd)
        self._reader_pidfds = []


class ShmRingHandle:
    """What a reader is given: pickled while spawning, it passes the ring's file descriptors to the
    child and comes out there as an attached ShmRingReader."""

    def __init__(self, mem_fd: int, ready_fd: int, free_fd: int, slot_bytes: int, num_slots: int,
                 writer_pid: int) -> None:  # fmt: skip
        self.fds = (mem_fd, ready_fd, free_fd)
        self.slot_bytes, self.num_slots, self.writer_pid = slot_bytes, num_slots, writer_pid

    def __reduce__(self):
        dup = tuple(reduction.DupFd(fd) for fd in self.fds)
        return ShmRingReader.attach, (dup, self.slot_bytes, self.num_slots, self.writer_pid)


class ShmRingReader:
    """A follower's end: read() returns the writer's messages in order."""

    def __init__(self, fds: tuple[int, int, int], slot_bytes: int, num_slots: int, writer_pid: int) -> None:
        mem_fd, self._ready, self._free = fds
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self._mem = mmap.mmap(mem_fd, slot_bytes * num_slots)
        os.close(mem_fd)  # the mapping keeps the memory
        try:
            self._writer_pidfd = os.pidfd_open(writer_pid)
        except ProcessLookupError:
            raise PeerGone("rank 0 exited before this rank started") from None
        self._available = 0  # slots announced and not yet read
        self._next = 0
        self.received = 0  # messages read (the rank's stop log reports them)

    @classmethod
    def attach(cls, dup_fds: tuple, slot_bytes: int, num_slots: int, writer_pid: int) -> ShmRingReader:
        return cls(tuple(d.detach() for d in dup_fds), slot_bytes, num_slots, writer_pid)

    def read(self) -> Any:
        parts: list[bytes] = []
        while True:
            self._wait_for_slot()
            offset = self._next * self.slot_bytes
            length, more = _HEADER.unpack_from(self._mem, offset)
            start = offset + _HEADER.size
            with memoryview(self._mem)[start : start + length] as view:
                if not more and not parts:  # one slot (the usual step): unpickled in place
                    obj = pickle.loads(view)
                else:
                    parts.append(bytes(view))
            self._next = (self._next + 1) % self.num_slots
            self._available -= 1
            os.eventfd_write(self._free, 1)  # only once the slot's bytes are no longer needed
            if not more:
                break
        self.received += 1
        return pickle.loads(b"".join(parts)) if parts else obj

    def _wait_for_slot(self) -> None:
        while self._available == 0:
            try:
                self._available += os.eventfd_read(self._ready)
            except BlockingIOError:
                # What rank 0 wrote before it exited (its STOP) is still read: ready is tried first.
                if _poll(self._ready, [self._writer_pidfd]) != self._ready:
                    raise PeerGone("rank 0 exited") from None

    def close(self) -> None:
        self._mem.close()
        for fd in (self._ready, self._free, self._writer_pidfd):
            os.close(fd)


def _poll(fd: int, pidfds: list[int]) -> int:
    """Sleep until fd or one of the pidfds is readable (a pidfd is, once its process has exited);
    fd if it is, else an exited process' pidfd."""
    poller = select.poll()
    for f in (fd, *pidfds):
        poller.register(f, select.POLLIN)
    ready = {f for f, _ in poller.poll()}
    return fd if fd in ready else ready.pop()
