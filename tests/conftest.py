"""Session-wide test environment, set before any test module imports torch or triton."""

import glob
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. at the first import of a
# kernel module, which any test may trigger: on a machine without an NVIDIA device the kernels can
# only run interpreted, so say so before anything is imported.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
