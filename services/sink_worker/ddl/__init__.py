"""DDL at a span's head and in its batches: the single-shard plan, shard DDL, the barrier."""
