"""Main job (``mcore_engine.recipes.distill``): pre-train a teacher GPT, distill it into a student.

    torchrun --standalone --nproc_per_node=2 tools/train.py                       # CPU demo, TP=2
    torchrun --nproc_per_node=8 tools/train.py --config configs/demo_gpu_8x.yaml  # 8 GPUs, TP=2 x DP=4
    make demo ARGS="distillation.steps=10"

Outputs in ``<output_dir>/<name>/``: metrics.jsonl, curves.png, config.yaml, checkpoints/{teacher,student}.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo_tiny_tp2.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="job YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                        help="config overrides, e.g. distillation.steps=10 student.optimizer.lr=3e-3")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Megatron-Core's import-time notes that it falls back to torch norms / optimizers without Apex or TE.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed",
                            category=UserWarning)
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.recipes import JobConfig, run_job

    cfg = JobConfig.from_yaml(args.config, args.overrides)        # parse (ValueError before any work)
    try:
        summary = run_job(cfg)                                     # build + train (both phases)
        if int(os.environ.get("RANK", "0")) == 0:
            print("summary: " + summary.line(), flush=True)
    finally:
        destroy_distributed()                                      # close


if __name__ == "__main__":
    main()
