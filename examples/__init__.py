"""Runnable examples for event-stream consumers (see contracts/README.md)."""
