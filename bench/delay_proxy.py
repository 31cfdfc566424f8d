"""A TCP proxy that delays every chunk by a fixed time each way.

Stands in for a remote Redis on a LAN where the kernel has no ``netem``
qdisc (this project's CI machine has none). Threads, not asyncio: event-loop
timers tick in milliseconds, ``time.sleep`` in microseconds. A chunk that
arrives while the previous one is still held waits for it, so the delay is a
floor, not exact; under load the service sends few, large chunks.

    python -m bench.delay_proxy LISTEN_PORT TARGET_PORT DELAY_US
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time


def pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
    try:
        while data := src.recv(1 << 16):
            due = time.monotonic() + delay
            while (left := due - time.monotonic()) > 0:
                time.sleep(left)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def serve(listen_port: int, target_port: int, delay_us: int) -> None:
    delay = delay_us / 1_000_000
    server = socket.create_server(("127.0.0.1", listen_port))
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target_port))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(client, upstream, delay), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client, delay), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
