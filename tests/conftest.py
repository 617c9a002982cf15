"""Session-wide test environment, set before any test module imports torch or triton."""

import glob
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, i.e. at the first import of a
# kernel module, which any test may trigger: on a machine without an NVIDIA device the kernels can
# only run interpreted, so say so before anything is imported.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    """Which megatron-core the run tests (``make test``: 0.16.1; ``make test-mcore-next``: 0.19.x)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"megatron-core {version('megatron-core')}"
    except PackageNotFoundError:
        return "megatron-core not installed"


def pytest_ignore_collect(collection_path, config):
    """Collect only ``test_*.py`` modules: helper modules (``utils.py``, ``reference.py``,
    ``engine_setup.py``, ...) are imported by the tests, never collected as tests themselves."""
    if collection_path.suffix == ".py" and collection_path.name != "conftest.py":
        return None if collection_path.name.startswith("test_") else True
    return None
