"""The train / infer step's internals: batch preparation into micro-batches, the lm-head outputs,
the loss guard, MTP losses and the optimizer."""
