"""The capture service."""
