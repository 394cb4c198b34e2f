"""Foreign-key cascades: table groups, their driver-side write, the barrier at a key-graph change."""
