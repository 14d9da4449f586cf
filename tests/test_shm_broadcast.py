"""The shared-memory step ring (worker/distributed/shm_broadcast.py) across real spawned processes:
messages arrive whole and in order through a ring far smaller than the run (wrap-around, steps many
slots long), readers sleep rather than spin, and a peer killed with SIGKILL is noticed on the other
side without a hang, nothing left in /dev/shm. And step_broadcast's choice of path with two "hosts"
of two ranks: the ring for rank 0's, gloo for the other's."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import shm_ring_peers
from process_fixtures import alive, wait_gone
from shm_ring_peers import BIG, digest, message

from kvscale.worker.distributed.shm_broadcast import PeerGone, ShmRingWriter, supported
from kvscale.worker.distributed.step_broadcast import PING

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux memfd, eventfd and pidfd")

SPAWN = multiprocessing.get_context("spawn")


def start(target, *args, daemon: bool = True) -> tuple[multiprocessing.Process, object]:
    receive, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=target, args=(*args, send), daemon=daemon)
    proc.start()
    send.close()
    return proc, receive


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_two_readers_get_every_message_in_order(shm_before):
    n = 3000  # 750 times round a 4-slot ring; 31 messages of 25 slots each
    ring = ShmRingWriter(2, slot_bytes=4096, num_slots=4)
    readers = [start(shm_ring_peers.read_all, handle) for handle in ring.handles]
    ring.watch([proc.pid for proc, _ in readers])
    for i in range(n):
        ring.write(message(i))
    ring.write(None)  # STOP: the readers leave their loop
    assert 20 * ring.slot_bytes < BIG and ring.sent == n + 1
    for proc, results in readers:
        assert results.recv() == (n, None, n + 1)
        proc.join(10)
        assert proc.exitcode == 0
    ring.close()


def test_idle_reader_sleeps_and_writer_notices_it_killed(shm_before):
    ring = ShmRingWriter(1, slot_bytes=4096, num_slots=4)
    proc, results = start(shm_ring_peers.read_forever, ring.handles[0])
    pid = results.recv()
    ring.watch([pid])
    ring.write(message(0))
    assert results.recv() == message(0)
    # Waiting for the next step in poll(2): no CPU burnt (a spinning reader would use a whole core).
    before = cpu_seconds(pid)
    assert not results.poll(1.0)
    assert cpu_seconds(pid) - before < 0.05
    os.kill(pid, signal.SIGKILL)
    proc.join(10)
    # The writer goes on until the dead reader's slots are full, then raises rather than waits.
    with pytest.raises(PeerGone):
        for i in range(ring.num_slots + 1):
            ring.write(message(i))
    ring.close()


def test_reader_exits_when_its_writer_is_killed(shm_before):
    writer, results = start(shm_ring_peers.write_then_idle, daemon=False)  # it has a child
    reader_pid = results.recv()
    assert [results.recv() for _ in range(3)] == [message(i) for i in range(3)]
    assert alive(reader_pid)
    os.kill(writer.pid, signal.SIGKILL)  # rank 0 dies; its reader has no PR_SET_PDEATHSIG here
    writer.join(10)
    wait_gone([reader_pid], timeout=10)  # the reader's poll saw rank 0's pidfd (PeerGone, exit 3)


def test_ring_on_rank0s_host_gloo_for_the_others(shm_before):
    """Two "hosts" of two ranks: rank 1 reads the ring, ranks 2 and 3 get the steps (and the idle
    PING, which the ring's readers never see) over their gloo step_group."""
    from server_fixtures import free_port

    steps = [message(i) for i in (0, 1, 13)]
    driver, results = start(shm_ring_peers.step_rank0, 4, free_port(), 2, steps, daemon=False)
    reports = {}
    while 0 not in reports:
        assert results.poll(120), reports
        rank, *report = results.recv()
        reports[rank] = report
    driver.join(30)
    assert driver.exitcode == 0 and reports[0] == [[0, 0, 0]]
    sent = [digest(s) for s in steps]
    assert reports[1] == ["shm", sent]
    assert reports[2] == reports[3] == ["gloo", [*sent, digest(PING)]]
