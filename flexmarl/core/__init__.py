"""What every part depends on: the declared seams (Sampler, Trainer, Checkpointer), the clock and the errors that name a fix."""
