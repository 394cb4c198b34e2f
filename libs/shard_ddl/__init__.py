"""Shard DDL coordination."""
