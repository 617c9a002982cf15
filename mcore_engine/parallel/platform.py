"""The platform layer's public names in one place (also importable as ``mcore_engine.platform``):
devices (:mod:`.device`), the CPU device layer (:mod:`.cpu_device`), Megatron-Core compatibility
patches (:mod:`.compat`) and distributed bring-up (:mod:`.distributed`)."""

from mcore_engine.parallel.compat import apply_mla_compat, apply_moe_compat, mcore_version, quiet_cpu_warnings
from mcore_engine.parallel.cpu_device import apply_cpu_device_layer, cpu_device_layer_active
from mcore_engine.parallel.device import Device, get_device
from mcore_engine.parallel.distributed import destroy_distributed, init_distributed, seed_everything

__all__ = ["Device", "apply_cpu_device_layer", "apply_mla_compat", "apply_moe_compat",
           "cpu_device_layer_active", "destroy_distributed", "get_device", "init_distributed",
           "mcore_version", "quiet_cpu_warnings", "seed_everything"]
