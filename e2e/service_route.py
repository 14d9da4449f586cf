"""Wait until the real node routes a Service's ClusterIP, the step between "a pod is Ready" and
"a client can connect" that every test reaching a Service from the host must wait out.

kube-proxy programs a Service's rules one sync after the EndpointSlice lists a ready pod (~1 s,
longer on a busy node). Until then a connection from the host is refused (kube-proxy's REJECT for
a Service without ready endpoints) or, for rules not written yet at all, finds no one on the
bridge the Service range is routed onto (realnode.py): EHOSTUNREACH once ARP gives up, ~3 s.
Both are retried to the deadline; any other error is raised at once. CI met each of the two right
after Ready (test_operator, test_zero_race) on a machine faster than this one.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import time

NOT_ROUTED_YET = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ECONNRESET)


def wait_routed(ip: str, port: int, timeout: float = 60.0) -> None:
    """Until a TCP connection to ip:port is accepted; on timeout, an error with kube-proxy's rules
    for ip, so a failure says whether kube-proxy had written them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((ip, port), timeout=10):
                return
        except OSError as e:
            if e.errno not in NOT_ROUTED_YET:
                raise
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{ip}:{port} not routed within {timeout:.0f} s ({e}); kube-proxy's rules for it:\n"
                    + rules_for(ip)
                ) from e
        time.sleep(0.25)


def rules_for(ip: str) -> str:
    save = "ip6tables-save" if ":" in ip else "iptables-save"
    try:
        out = subprocess.run([save], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({save}: {e})"
    return "\n".join(line for line in out.splitlines() if ip in line) or "(none)"
