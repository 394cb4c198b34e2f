"""Event models, one module per domain. Importing this package fills the registry."""

from contracts.events import (
    changefeeds,
    leadership,
    members,
    rows,
    scheduling,
    shard_ddl,
    sink,
    snapshots,
    sources,  # the sources registry
    syncpoints,  # consistent points across tables
    table_incidents,  # poison: tables stopped by their downstream
)

__all__ = ["changefeeds", "leadership", "members", "rows", "scheduling", "shard_ddl", "sink", "snapshots"]
__all__ += ["table_incidents"]
__all__ += ["sources"]
__all__ += ["syncpoints"]
