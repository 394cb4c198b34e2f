"""The ddl-lock service."""
