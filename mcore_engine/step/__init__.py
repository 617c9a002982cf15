"""The train / infer step's internals: the layout's fixed values, batch preparation into
micro-batches, the schedule and its callbacks, the lm-head outputs, the loss guard, MTP losses and
the optimizer."""
