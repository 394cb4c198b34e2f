"""The row-value codec both sides of the ROWS contract share.

- ``encode``: binlog / source Python values to the contract's JSON (capture, the initial load).
- ``decode``: the contract's JSON to driver values, source types to target types, and fetched
  target values back to the same Python types (sinks, validation, the apply jobs).
- ``table_meta``: a table's columns, kinds and keys from information_schema or the binlog.
"""
