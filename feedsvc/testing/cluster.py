"""A real local Redis Cluster for tests and benchmarks: N primaries started
with ``redis-server --cluster-enabled yes`` on free ports and joined with
``redis-cli --cluster create`` (or by hand where there is no redis-cli);
optionally a replica each; plus the slot move and the failover used by the
migration and failover tests.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from feedsvc.embedded_redis.server import RedisServer, RedisServerError, pick_free_port

BUS_OFFSET = 10_000  # a node's cluster bus listens on its port + 10000
MANUAL_FAILOVER_WAIT = 6.0  # Redis gives up a CLUSTER FAILOVER after 5 s
NODE_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "2000",
             # a replica's first sync starts at once, not after the default 5 s
             # that diskless sync waits for more replicas to come along
             "--repl-diskless-sync-delay", "0")  # fmt: skip


def command(client: redis.Redis, *args: Any) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_node_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = pick_free_port()
        if port != 6379 and port + BUS_OFFSET < 65536 and _free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_cli() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


class LocalCluster:
    """``primaries`` redis-server processes joined into one cluster on
    127.0.0.1, and with ``replicas`` one replica per primary: node
    ``primaries + i`` replicates node ``i``."""

    def __init__(self, root: Path, primaries: int = 3, replicas: bool = False) -> None:
        self.primaries = primaries
        self._joined = primaries  # nodes that are part of the cluster so far
        self.nodes = [
            self._node(root / f"node{i}") for i in range(primaries * (2 if replicas else 1))
        ]
        self._ports_fixed = False  # once started, the nodes keep their ports

    @staticmethod
    def _node(data_dir: Path) -> RedisServer:
        return RedisServer(data_dir, port=pick_node_port(), appendfsync="no", extra_args=NODE_ARGS)

    @property
    def url(self) -> str:
        """The URL feedsvc takes: any one node is enough to find the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def client(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.nodes[index].port, protocol=2)

    def start(self, timeout: float = 30.0) -> None:
        for i in range(len(self.nodes)):
            self._start_node(i)
        self._ports_fixed = True
        cli = redis_cli()
        if cli is not None:
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes[: self.primaries]]
            subprocess.run(
                [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                 "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout,
            )  # fmt: skip
        else:
            self._join()
        self._wait(self._settled, timeout, "the test cluster did not settle")
        if len(self.nodes) > self.primaries:
            self._add_replicas(timeout)

    def _start_node(self, index: int, attempts: int = 5) -> None:
        """Start a node; at the first start, a port taken since it was picked
        (by another process: test runs in parallel pick ports at the same
        time) is given up for new ones."""
        for attempt in range(1, attempts + 1):
            node = self.nodes[index]
            try:
                node.start()
                return
            except RedisServerError as error:
                if self._ports_fixed or attempt == attempts or "already in use" not in str(error):
                    raise
            shutil.rmtree(node.data_dir, ignore_errors=True)  # its nodes.conf names the old port
            self.nodes[index] = self._node(node.data_dir)

    @staticmethod
    def _wait(done: Callable[[], bool], timeout: float, failure: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            time.sleep(0.1)

    def _add_replicas(self, timeout: float) -> None:
        """Each extra node meets the cluster, then replicates its primary."""
        with self.client(0) as client:
            for node in self.nodes[self.primaries :]:
                command(client, "CLUSTER", "MEET", "127.0.0.1", node.port)
        self._joined = len(self.nodes)
        self._wait(self._settled, timeout, "the replicas did not join")
        ids = self.node_ids()
        for i in range(self.primaries, len(self.nodes)):
            with self.client(i) as client:
                command(client, "CLUSTER", "REPLICATE", ids[i - self.primaries])

        def in_sync() -> bool:
            for i in range(self.primaries, len(self.nodes)):
                with self.client(i) as client:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
            return self._settled() and self._pairs_known(ids)

        self._wait(in_sync, timeout, "the replicas did not catch up")

    def _pairs_known(self, ids: list[str]) -> bool:
        """Every node sees every replica as the replica of its primary. A
        CLUSTER FAILOVER needs the primaries' votes, and a primary that has
        not heard of the pairing yet refuses its vote."""
        replicas = []
        for node in range(len(self.nodes)):
            with self.client(node) as client:
                if command(client, "ROLE")[0] == b"slave":
                    replicas.append(node)
        if len(replicas) != len(self.nodes) - self.primaries:
            return False
        for node in range(len(self.nodes)):
            with self.client(node) as client:
                lines = command(client, "CLUSTER", "NODES").decode().splitlines()
            seen = {fields[0]: fields for fields in map(str.split, lines)}
            for replica in replicas:
                fields = seen.get(ids[replica])
                primary = ids[self.counterpart(replica)]
                if fields is None or "slave" not in fields[2] or fields[3] != primary:
                    return False
        return True

    def counterpart(self, node: int) -> int:
        """The other node of a primary/replica pair (whichever is primary now)."""
        return node + self.primaries if node < self.primaries else node - self.primaries

    def fail_over(self, primary: int, timeout: float = 30.0) -> int:
        """Promote ``primary``'s replica with a coordinated CLUSTER FAILOVER
        (the replica catches up first, so no acknowledged write is lost);
        returns the index of the new primary. Returns once the pair has
        turned round (the old primary replicates the new one and every node
        knows it), so the cluster is ready for the next failover."""
        replica = self.counterpart(primary)
        ids = self.node_ids()

        def promoted() -> bool:
            with self.client(replica) as client:
                role = command(client, "ROLE")[0]
            with self.client(primary) as client:
                link = client.info("replication").get("master_link_status")
            return (
                bool(role == b"master")
                and link == "up"
                and self._settled()
                and self._pairs_known(ids)
            )

        deadline = time.monotonic() + timeout
        while True:
            with self.client(replica) as client:
                if command(client, "ROLE")[0] == b"slave":
                    command(client, "CLUSTER", "FAILOVER")
            # A primary votes for a replica of the same primary at most once
            # in twice the node timeout; a refused vote lets the manual
            # failover lapse after 5 s, and then it is asked for again.
            wait = min(MANUAL_FAILOVER_WAIT, deadline - time.monotonic())
            try:
                self._wait(promoted, wait, "the failover did not complete")
                return replica
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise

    def kill_primary(self, primary: int, timeout: float = 60.0) -> int:
        """kill -9 ``primary``: its replica takes over by itself once the
        others have seen it gone (the node timeout; nothing coordinates, so
        writes the replica had not received yet are gone). The killed node is
        then started again and rejoins as the new primary's replica. Returns
        the index of the new primary, once the pair has turned round."""
        replica = self.counterpart(primary)
        ids = self.node_ids()
        self.nodes[primary].kill()

        def took_over() -> bool:
            with self.client(replica) as client:
                return bool(command(client, "ROLE")[0] == b"master")

        self._wait(took_over, timeout, "the replica did not take over")
        self.nodes[primary].start()

        def rejoined() -> bool:
            with self.client(primary) as client:
                link = client.info("replication").get("master_link_status")
            return link == "up" and self._settled() and self._pairs_known(ids)

        self._wait(rejoined, timeout, "the killed primary did not rejoin as a replica")
        return replica

    def _join(self) -> None:
        """What ``redis-cli --cluster create`` does, for machines without
        redis-cli (e.g. only the bundled server binary): share the slots out
        evenly, then introduce the nodes to each other."""
        share = 16384 // self.primaries
        for i in range(self.primaries):
            last = 16383 if i == self.primaries - 1 else (i + 1) * share - 1
            with self.client(i) as client:
                command(client, "CLUSTER", "ADDSLOTSRANGE", i * share, last)
                command(client, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        with self.client(0) as client:
            for node in self.nodes[1 : self.primaries]:
                command(client, "CLUSTER", "MEET", "127.0.0.1", node.port)

    def _settled(self) -> bool:
        """Every node sees every node and all 16384 slots served."""
        for i in range(self._joined):
            with self.client(i) as client:
                info = client.cluster("INFO")
                known = int(info["cluster_known_nodes"])
                if info["cluster_state"] != "ok" or known != self._joined:
                    return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    # -- resharding ----------------------------------------------------------

    def node_ids(self) -> list[str]:
        ids = []
        for i in range(len(self.nodes)):
            with self.client(i) as client:
                ids.append(client.cluster("MYID").decode())
        return ids

    def owner(self, slot: int) -> int:
        """Index of the node that serves a slot."""
        with self.client(0) as client:
            for start, end, primary, *_ in command(client, "CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = primary[1]
                    return [n.port for n in self.nodes].index(port)
        raise LookupError(slot)

    def move_slot(self, slot: int, target: int, batch: int = 10, pause: float = 0.02) -> int:
        """Move one slot to node ``target`` the way redis-cli does (IMPORTING,
        MIGRATING, MIGRATE the keys a few at a time, SETSLOT NODE everywhere),
        slowly, so that clients meet ASK, TRYAGAIN and then MOVED. Returns the
        number of keys moved."""
        source = self.owner(slot)
        ids = self.node_ids()
        src, dst = self.client(source), self.client(target)
        moved = 0
        try:
            command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
            command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            while keys := command(src, "CLUSTER", "GETKEYSINSLOT", slot, batch):
                command(
                    src, "MIGRATE", "127.0.0.1", self.nodes[target].port, "", 0, 5000, "KEYS", *keys
                )
                moved += len(keys)
                time.sleep(pause)
            for i in range(len(self.nodes)):
                with self.client(i) as client:
                    command(client, "CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        finally:
            src.close()
            dst.close()
        return moved
