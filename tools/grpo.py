"""GRPO recipe (``mcore_engine.recipes.grpo``): a tiny policy learns a rule-rewarded toy task.

    torchrun --standalone --nproc_per_node=2 tools/grpo.py                  # CPU, TP=2
    make grpo ARGS="grpo.steps=10"
    make grpo ARGS="--config configs/grpo_tiny_lora_tp2.yaml"                # LoRA

Outputs in ``<output_dir>/<name>/``: metrics.jsonl, curves.png, config.yaml. Several finished runs in
one figure (no training, no torchrun)::

    python tools/grpo.py --plot docs/grpo_curve.png --run "full=runs/grpo" --run "LoRA=runs/grpo_lora"
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_tiny_tp2.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="job YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                        help="config overrides, e.g. grpo.steps=10 policy.optimizer.lr=3e-3")
    parser.add_argument("--plot", metavar="PNG", help="plot the --run folders into PNG instead of training")
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=RUN_DIR",
                        help="with --plot: a finished run's folder and its legend label (repeatable)")
    args = parser.parse_args(argv)
    if bool(args.plot) != bool(args.run):
        parser.error("--plot and --run go together")
    if args.plot and args.overrides:
        parser.error("--plot takes no config overrides")
    if any("=" not in run for run in args.run):
        parser.error("--run takes LABEL=RUN_DIR")
    return args


def plot_runs(png: str, runs: list[str]) -> None:
    """One figure of several runs; the uniform-policy line when every run has the same vocabulary."""
    import yaml

    from mcore_engine.recipes.logging import plot_grpo_runs

    folders = dict(run.rsplit("=", 1) for run in runs)
    vocabs = set()
    for folder in folders.values():
        with open(Path(folder) / "config.yaml") as f:
            vocabs.add(yaml.safe_load(f)["policy"]["model"]["vocab_size"])
    plot_grpo_runs(folders, png, chance=1.0 / vocabs.pop() if len(vocabs) == 1 else None)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        plot_runs(args.plot, args.run)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Megatron-Core's import-time notes that it falls back to torch norms / optimizers without Apex or TE.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed",
                            category=UserWarning)
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.recipes.grpo import run_grpo
    from mcore_engine.recipes.grpo_config import GRPOJobConfig

    cfg = GRPOJobConfig.from_yaml(args.config, args.overrides)     # parse (ValueError before any work)
    try:
        summary = run_grpo(cfg)                                    # build + train
        if int(os.environ.get("RANK", "0")) == 0:
            print("summary: " + summary.line(), flush=True)
    finally:
        destroy_distributed()                                      # close


if __name__ == "__main__":
    main()
