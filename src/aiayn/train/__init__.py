"""Training: the loss, the schedule, batching by tokens, checkpoints, many processes, `train(config)`."""
