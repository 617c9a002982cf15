"""Device and process-group bring-up (NCCL / gloo), the CPU device layer and CPU collectives."""
