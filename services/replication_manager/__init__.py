"""The replication-manager service."""
