"""TensorDict batches at the engine boundary, in layers that import only earlier ones: ``layout``
(jagged / padded tokens), ``flags`` (``StepFlags``), ``validation``, ``micro_batching``, ``packing``
(thd / bshd model inputs and back)."""
