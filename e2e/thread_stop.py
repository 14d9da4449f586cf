"""Freeze one thread of a running process, leaving its other threads running: a hung engine
thread (a kernel that never returns, a deadlock) made on demand, from outside the process, with
no test code inside the worker image.

ptrace(2) attaches to threads one at a time: PTRACE_SEIZE then PTRACE_INTERRUPT stops that thread
alone (SIGSTOP would stop the whole process). The tracer must stay alive for the thread to stay
stopped, and must reap its exit when the kubelet kills the container, so it is a child process of
its own, driven over stdin:

    python e2e/thread_stop.py PID THREAD_NAME
    stdin "stop\\n" -> stops the thread, prints "stopped"; "cont\\n" -> resumes it, prints "running";
    stdin closed -> detaches (the thread runs on) and exits; the thread's exit -> prints "exited".

Root (CAP_SYS_PTRACE) is needed: the worker runs as uid 1000 in its own PID namespace.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

PTRACE_CONT, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 7, 17, 0x4206, 0x4207
WALL = 0x40000000  # __WALL: wait for a thread that is not this process's child


def thread_id(pid: int, name: str) -> int:
    """The TID (host namespace) of pid's thread called `name` (/proc/<pid>/task/<tid>/comm)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == name:
            return int(task.name)
    raise LookupError(f"process {pid} has no thread named {name!r}")


def main(pid: int, name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long

    def ptrace(request: int, tid: int) -> None:
        if libc.ptrace(request, tid, None, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")

    tid = thread_id(pid, name)
    ptrace(PTRACE_SEIZE, tid)

    def wait_stop() -> bool:
        """Until the thread stops (True) or is gone (False)."""
        try:
            _, status = os.waitpid(tid, WALL)
        except ChildProcessError:
            return False
        return os.WIFSTOPPED(status)

    for line in sys.stdin:
        command = line.strip()
        if command == "stop":
            ptrace(PTRACE_INTERRUPT, tid)
            print("stopped" if wait_stop() else "exited", flush=True)
        elif command == "cont":
            ptrace(PTRACE_CONT, tid)
            print("running", flush=True)
        elif command == "wait-exit":
            # Stay stopped whatever happens (a stop for a signal is left as it is) until the thread
            # dies with its process: reaping it lets the container's exit be seen.
            while wait_stop():
                pass
            print("exited", flush=True)
            return
    libc.ptrace(PTRACE_DETACH, tid, None, None)


def in_user_code(tid: int) -> bool:
    """Whether the stopped thread `tid` was stopped in its own code rather than in a system call.

    /proc/<tid>/syscall gives the number of the system call a blocked thread is in, -1 when it is
    not in one. A thread waiting for the GIL (or any lock) is in a futex call: frozen there, it may
    hold a Python-level lock (a queue's, an Event's) that the event loop then waits for for ever,
    a state no real hang reaches. Frozen in user code without the GIL, it is inside a native
    kernel (a torch op), where real hangs sit.
    """
    return where_stopped(tid) == "-1"


def where_stopped(tid: int) -> str:
    """The system call number the stopped thread `tid` is in ("-1": none, its own code)."""
    return Path(f"/proc/{tid}/syscall").read_text().split()[0]


class ThreadStopper:
    """Drives `main` in a child process: stop(), cont(), wait_exit(); close() detaches."""

    def __init__(self, pid: int, name: str) -> None:
        self.tid = thread_id(pid, name)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(pid), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _say(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"thread_stop.py died on {command!r} (rc {self.proc.wait()})")
        return answer

    def stop(self) -> str:
        return self._say("stop")

    def cont(self) -> str:
        return self._say("cont")

    def in_user_code(self) -> bool:
        """After stop(): see in_user_code."""
        return in_user_code(self.tid)

    def where_stopped(self) -> str:
        """After stop(): see where_stopped."""
        return where_stopped(self.tid)

    def wait_exit_in_background(self) -> None:
        """From now on the thread stays stopped until it exits; the child reaps it and exits."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("wait-exit\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a tracer's exit detaches its tracees
            self.proc.wait()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
