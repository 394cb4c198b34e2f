"""Initial load: chunk plan, the Spark bulk copy, the source read and the watermark hand-over."""
