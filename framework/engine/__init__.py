"""Engine internals: sequences, block manager, scheduler, model runner, sampler, steps."""
