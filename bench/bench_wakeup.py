"""What waking an idle process costs on this machine: the round trip of a 300-byte TCP
ping-pong on loopback to an echo process that has been idle for a given time.

    python bench/bench_wakeup.py

Why it matters for kvroute: bench_proxy.py's interleaved latency measure leaves the proxy
idle while the direct and bare requests run (1-2 ms), so each proxied request first
wakes it; on a VM that wake-up alone can cost more than the proxy's own work (the vCPU
of an idle process is descheduled, and the host takes time to run it again). A direct
request pays no such penalty (the fake backend is kept busy by every target). Compare
the interleaved and the steady figures of bench_proxy.py with what this prints.
"""

from __future__ import annotations

import os
import socket
import statistics
import time


def main() -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    pid = os.fork()
    if pid == 0:  # the echo process: blocks in recv() between pings
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := c.recv(65536):
            c.sendall(data)
        os._exit(0)
    s = socket.create_connection(ls.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        # The sender waits by sleeping (both processes idle: they may share a vCPU) or
        # by spinning (its vCPU stays busy: the echo must be woken on the other one).
        for how in ("sleeping", "spinning"):
            for idle_ms in (0.0, 0.2, 1.0, 3.0):
                rtts = []
                for _ in range(1000):
                    if how == "sleeping" and idle_ms:
                        time.sleep(idle_ms / 1000)
                    elif idle_ms:
                        end = time.perf_counter() + idle_ms / 1000
                        while time.perf_counter() < end:
                            pass
                    t0 = time.perf_counter()
                    s.sendall(b"x" * 300)
                    s.recv(65536)
                    rtts.append(time.perf_counter() - t0)
                print(f"echo idle {idle_ms:3.1f} ms before each ping, sender {how}: "
                      f"round trip median {statistics.median(rtts[100:]) * 1e6:6.1f} us")
    finally:
        s.close()
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
