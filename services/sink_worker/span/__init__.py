"""A span in this worker: its config and runtime, its state machine, where it starts, its checkpoints."""
