"""A round of the sink-worker: pull, plan, cut, apply, write, checkpoint advance, pacing."""
