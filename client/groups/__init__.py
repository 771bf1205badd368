"""The SDK over a cluster of daemon groups (``cluster://`` targets): routing by pool.

:class:`~client.groups.router.ClusterClient` is the client; see
:mod:`client.groups.router`.
"""

from client.groups.router import ClusterClient, connect
from client.groups.routes import parse_cluster_target

__all__ = ["ClusterClient", "connect", "parse_cluster_target"]
