"""Downstream sinks behind one interface: MySQL/MariaDB, PostgreSQL, SQLite."""
