"""Vocab-parallel math on lm-head logits sharded over the tensor-parallel group (see API.md).

Every op works on ``z = logits / temperature`` chunk by chunk without materialising it, outputs
float32, and never modifies its inputs. ``vocab_parallel_logits_outputs`` computes any subset of
the outputs in one pass; the named ops are thin wrappers over it.
"""

from mcore_engine.ops.entropy import vocab_parallel_entropy
from mcore_engine.ops.forward_kl_topk import vocab_parallel_forward_kl_topk
from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.log_probs import vocab_parallel_log_probs
from mcore_engine.ops.sum_pi_squared import vocab_parallel_sum_pi_squared
from mcore_engine.ops.temperature import is_scalar_unit_temperature, scale_logits_by_temperature
from mcore_engine.ops.topk import vocab_parallel_topk

__all__ = [
    "is_scalar_unit_temperature",
    "scale_logits_by_temperature",
    "vocab_parallel_entropy",
    "vocab_parallel_forward_kl_topk",
    "vocab_parallel_log_probs",
    "vocab_parallel_logits_outputs",
    "vocab_parallel_sum_pi_squared",
    "vocab_parallel_topk",
]
