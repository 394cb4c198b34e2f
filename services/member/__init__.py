"""The member service."""
