"""Real processes for tests, benchmarks and load tests: ``feedsvc serve`` as a
child process (:mod:`feedsvc.testing.service`) and a local Redis Cluster
(:mod:`feedsvc.testing.cluster`). Nothing here is used by the service itself.
"""

from feedsvc.testing.cluster import LocalCluster
from feedsvc.testing.service import ServiceError, ServiceProcess

__all__ = ["LocalCluster", "ServiceError", "ServiceProcess"]
