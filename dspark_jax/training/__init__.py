"""Training the DSpark drafter: losses, the jitted train step, data and the training loop."""
