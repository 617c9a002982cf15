"""TensorDict batches at the engine boundary, in layers (each imports only those above it):

- ``layout``: how a batch lays out its tokens (jagged ``[B, j]`` or padded ``[B, S]``);
- ``flags``: the step's non-tensor flags -> a frozen ``StepFlags``;
- ``validation``: ``validate_batch`` (``ValueError`` naming the key);
- ``micro_batching``: split by count or token budget, put outputs back in order;
- ``packing``: micro-batch -> Megatron-Core ``thd`` / ``bshd`` model inputs and back.
"""
