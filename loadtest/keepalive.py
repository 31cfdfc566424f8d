"""A mend of geventhttpclient's connection pool for Locust runs of more than
about 1,000 users per process (loadtest/README.md, "A Locust pitfall")."""

from __future__ import annotations

from typing import Any


def keep_alive_past_fd_1023() -> None:
    """geventhttpclient checks a pooled socket with select(), which raises
    ValueError for a descriptor >= 1024 and so calls every such socket dead:
    beyond about 1,000 users per process each request would open a new
    connection (a handshake, an accept and a TIME_WAIT socket per request,
    and a latency tail that is the load generator's, not the service's).
    Same check with poll(0), which has no such limit and never blocks.
    (Called by the locustfile after locust has monkey-patched the standard
    library; the imports are inside for that reason.)"""
    import select

    from gevent.monkey import get_original
    from geventhttpclient.connectionpool import ConnectionPool

    poll = get_original("select", "poll")

    def is_socket_alive(self: ConnectionPool, sock: Any) -> bool:
        if sock is None or sock.fileno() < 0:
            return False
        poller = poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        # readable while idle means a FIN or stray bytes: not reusable either way
        return not poller.poll(0)

    if hasattr(ConnectionPool, "_is_socket_alive"):
        ConnectionPool._is_socket_alive = is_socket_alive  # type: ignore[method-assign]
