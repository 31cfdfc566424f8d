"""The local Redis Cluster now lives in :mod:`feedsvc.testing.cluster`, where
bench/ can import it too; this name stays for the modules that still import
it from here (tests/conftest.py)."""

from feedsvc.testing.cluster import (
    BUS_OFFSET,
    NODE_ARGS,
    LocalCluster,
    command,
    pick_node_port,
    redis_cli,
)

__all__ = ["BUS_OFFSET", "NODE_ARGS", "LocalCluster", "command", "pick_node_port", "redis_cli"]
