"""The sink-worker service."""
