"""Event models, one module per domain. Importing this package fills the registry."""

from contracts.events import leadership, members, snapshots

__all__ = ["leadership", "members", "snapshots"]
