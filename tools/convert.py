"""Convert between Hugging Face folders and engine checkpoints (Llama / Qwen2 / Qwen3).

    # HF -> engine checkpoint (fresh optimizer state) at TP=2, on 2 ranks
    torchrun --nproc_per_node=2 tools/convert.py hf-to-mcore --hf HF_DIR --out CKPT --tp 2
    # engine checkpoint -> HF folder (with the world size the checkpoint was written with)
    torchrun --nproc_per_node=2 tools/convert.py mcore-to-hf --ckpt CKPT --out HF_OUT [--hf-base HF_DIR]

``--hf-base`` supplies config fields and tokenizer files. TP = PP = 1 runs without torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

from mcore_engine import MegatronEngine
from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf import export_hf, from_hf_config, load_hf_weights, read_hf_config

CONFIG_FILE = "engine_config.yaml"


def hf_to_mcore(args: argparse.Namespace) -> None:
    cfg = EngineConfig(
        model=from_hf_config(read_hf_config(args.hf)),
        parallel=ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                virtual_pipeline_model_parallel_size=args.vpp),
        precision=args.precision)
    engine = MegatronEngine(cfg)
    engine.initialize()
    load_hf_weights(engine.model, args.hf, cfg)
    engine.optimizer.reload_model_params()  # bf16: refresh the fp32 main copies
    engine.save_checkpoint(args.out)
    if dist.get_rank() == 0:
        cfg.to_yaml(os.path.join(args.out, CONFIG_FILE))
    dist.barrier()


def mcore_to_hf(args: argparse.Namespace) -> None:
    cfg = EngineConfig.from_yaml(args.config or os.path.join(args.ckpt, CONFIG_FILE))
    engine = MegatronEngine(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=None)))
    engine.initialize()
    engine.load_checkpoint(args.ckpt)
    base = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=args.hf_base))
    export_hf(engine.model, base, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face folder -> engine checkpoint")
    a.add_argument("--hf", required=True, help="Hugging Face folder (config.json + safetensors)")
    a.add_argument("--out", required=True, help="engine checkpoint folder to write")
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--vpp", type=int, default=None)
    a.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    b = sub.add_parser("mcore-to-hf", help="engine checkpoint -> Hugging Face folder")
    b.add_argument("--ckpt", required=True, help="engine checkpoint folder")
    b.add_argument("--out", required=True, help="Hugging Face folder to write")
    b.add_argument("--config", default=None, help=f"engine YAML (default: CKPT/{CONFIG_FILE})")
    b.add_argument("--hf-base", default=None, help="source HF folder: config fields and tokenizer files")
    b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="tensor dtype of the export (default: the parameters')")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            hf_to_mcore(args)
        else:
            mcore_to_hf(args)
    finally:
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()


if __name__ == "__main__":
    main()
