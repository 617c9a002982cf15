"""mcore-engine: a Megatron-Core tensor-parallel training backend for RL post-training.

Install torch first, pinned (``pip install torch==2.13.0`` on CPU machines), then this package:
an unpinned torch requirement resolved on a machine without torch pulls a multi-GB CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="mcore-engine",
    version="0.1.0",
    description="Megatron-Core tensor-parallel training backend for RL post-training",
    python_requires=">=3.11",
    # kernels/ installs as ``mcore_engine_kernels``: the PyPI name ``kernels`` belongs to another project.
    packages=find_packages(include=["mcore_engine", "mcore_engine.*"]) + ["mcore_engine_kernels"],
    package_dir={"mcore_engine_kernels": "kernels"},
    # verl's trainer config selecting this backend (--config-path pkg://mcore_engine.integrations.verl_hydra)
    package_data={"mcore_engine.integrations.verl_hydra": ["*.yaml"]},
    install_requires=[
        "torch>=2.11",
        # The range the code supports: CI tests 0.16.1 (constraints.txt, the newest for Python 3.11)
        # and 0.19.x (`make test-mcore-next`). From 0.17 `import megatron.core` imports triton
        # (CUDA torch wheels bring it; on CPU the `kernels` extra does).
        "megatron-core>=0.16.1,<0.20",
        "tensordict==0.15.3",
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "numpy",
        "psutil",  # megatron.core.dist_checkpointing (checkpoints)
    ],
    extras_require={
        "dev": ["pytest>=8", "ruff>=0.6"],
        "kernels": ["triton>=3.0"],
        "hf": ["transformers>=4.45", "safetensors>=0.4"],
        # What the modules of verl 0.9.1 that mcore_engine.integrations.verl uses import. verl itself
        # goes in with `pip install --no-deps verl==0.9.1` (its pins on tensordict / transformers are
        # older than ours); install this extra under `-c constraints.txt` so no second torch comes in.
        "verl": ["ray", "msgpack", "protobuf", "requests", "jsonschema", "psutil", "omegaconf", "hydra-core",
                 "dill", "codetiming", "orjson", "accelerate", "peft", "datasets", "pandas", "pyarrow>=19",
                 "multiprocess", "xxhash", "fastapi", "starlette", "uvicorn", "opentelemetry-api",
                 # verl's trainer (tests/integrations/test_verl_trainer.py): main_ppo's data loader,
                 # its agent / reward / teacher loops
                 "torchdata", "cachetools", "aiohttp"],
        # SkyRL 0.3.0's Tinker API server (mcore_engine.integrations.tinker, docs/tinker.md): its light
        # dependencies and the tinker client. skyrl itself goes in with `pip install --no-deps
        # skyrl==0.3.0` (its pins on transformers / peft are older than ours); constraints.txt holds the
        # versions tested with it.
        "tinker": ["fastapi", "uvicorn", "sqlmodel", "sqlalchemy[asyncio]", "aiosqlite", "psutil",
                   "cloudpathlib", "rich", "numpy", "httpx", "typing_extensions", "tinker==0.24.1"],
    },
)
