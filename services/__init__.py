"""Sluice services: one package each, started with ``python -m services.<name>``."""
