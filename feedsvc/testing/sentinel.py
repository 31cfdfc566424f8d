"""A real local Redis Sentinel set-up for tests and measurements: a master,
a replica and one sentinel watching them under a service name, all on
127.0.0.1 and free ports, with short failure-detection times so a killed
master is replaced in a few seconds.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from feedsvc.embedded_redis.server import HOST, RedisServer

SERVICE = "feedsvc"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
# A replica's first sync starts at once, not after the 5 s that diskless sync
# waits by default for more replicas to come along (either server may be the
# master after a failover).
SYNC_NOW = ("--repl-diskless-sync-delay", "0")


class SentinelServer(RedisServer):
    """``redis-server <conf> --sentinel``: a sentinel needs a config file of
    its own, which it rewrites as it learns the topology."""

    def __init__(self, data_dir: Path, master_port: int, quorum: int = 1) -> None:
        super().__init__(data_dir, appendonly=False)
        self._master_port = master_port
        self._quorum = quorum

    def _args(self) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        if not conf.exists():  # the sentinel keeps its learnt state in it across restarts
            conf.write_text(
                f"sentinel monitor {SERVICE} {HOST} {self._master_port} {self._quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
        return [
            self.executable, str(conf), "--sentinel",
            "--bind", HOST,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip


class LocalSentinel:
    """Master, replica and sentinel; ``url`` is the feedsvc URL for them."""

    def __init__(self, root: Path, appendfsync: str = "everysec") -> None:
        self.master = RedisServer(root / "master", appendfsync=appendfsync, extra_args=SYNC_NOW)
        self.replica = RedisServer(
            root / "replica",
            appendfsync=appendfsync,
            extra_args=[*SYNC_NOW, "--replicaof", HOST, str(self.master.port)],
        )
        self.sentinel = SentinelServer(root / "sentinel", self.master.port)

    @property
    def url(self) -> str:
        return f"redis+sentinel://{HOST}:{self.sentinel.port}/{SERVICE}"

    def start(self, timeout: float = 30.0) -> None:
        self.master.start()
        self.replica.start()
        self.sentinel.start()
        deadline = time.monotonic() + timeout
        while not self._replica_known():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel never saw the replica in sync")
            time.sleep(0.1)

    def _replica_known(self) -> bool:
        try:
            with redis.Redis(port=self.sentinel.port, socket_timeout=2) as client:
                replicas = client.sentinel_slaves(SERVICE)
        except redis.RedisError:
            return False
        return any(r.get("master-link-status") == "ok" for r in replicas)

    def master_port(self) -> int | None:
        """The port of the master the sentinel names now."""
        try:
            with redis.Redis(port=self.sentinel.port, socket_timeout=2) as client:
                address = client.sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        return int(address[1]) if address else None

    def wait_for_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Block until the sentinel names a master other than old_port; its port."""
        deadline = time.monotonic() + timeout
        while True:
            port = self.master_port()
            if port is not None and port != old_port:
                return port
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not fail over in time")
            time.sleep(0.1)

    def failover(self) -> None:
        """SENTINEL FAILOVER: promote the replica, demote the master (it stays up)."""
        with redis.Redis(port=self.sentinel.port, socket_timeout=5) as client:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()
