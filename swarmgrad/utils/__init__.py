"""Bottom layer: errors, time, logging and the loop-thread runtime."""
