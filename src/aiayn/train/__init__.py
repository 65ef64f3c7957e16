"""Training: the loss, the schedule, batching by tokens, checkpoints, many processes, `loop.train(config)`."""
