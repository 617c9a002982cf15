"""Benchmark: one ``train_batch`` of a vision-language model with images against the same number of
text-only tokens, and the vision tower frozen (``model.freeze_vision_tower``) against trained.

    python tools/bench_vlm.py            # 4 samples x 384 tokens: 4 x 224x224 or 1 x 448x448 images each
    python tools/bench_vlm.py --quick    # a tiny model, 2 samples x 48 tokens (seconds per row)

A Qwen2.5-VL-shaped model scaled down to run on a CPU (``ModelConfig.vision``, the tower =
``transformers``' own ``Qwen2_5_VisionTransformerPretrainedModel``): the language model has
``--layers`` layers of hidden ``--hidden``, ``--heads`` query heads of ``hidden / heads`` in
``--groups`` key / value groups, QKV bias, SwiGLU ``--ffn``, RMSNorm, vocab ``--vocab``, sectioned mRoPE
(t / h / w = 1/4, 3/8, 3/8 of the rotary pairs, as Qwen2.5-VL's [16, 24, 24] of 64); the tower has
``--tower-depth`` blocks of width ``--tower-hidden`` (``--tower-heads`` heads, gated SiLU MLP
``--tower-ffn``), patches of 14 x 14 x 2 frames, windowed attention (112-pixel windows) in every block
but the last (full attention over the image), merged 2 x 2 into one language-model token of width
``--hidden``. A ``H x W`` image is ``H W / 14^2`` patches and ``H W / 28^2`` visual tokens (224 x 224:
256 patches, 64 tokens; 448 x 448: 1024 patches, 256 tokens).

One batch of ``--samples`` samples (one micro-batch, packed: thd), one rank, fp32, CPU or one GPU.
``--images`` lists the image configurations, ``SIZE:COUNT`` (``224:4``: four 224 x 224 images per
sample; ``HxW:COUNT`` for other shapes): each sample is ``--text-tokens`` text tokens (random ids, the
``<|vision_start|>`` / ``<|vision_end|>`` pair of each image included) around its images'
``<|image_pad|>`` runs; random RGB images through ``transformers``' Qwen2-VL image processor (PIL
backend, no torchvision) into ``multi_modal_inputs`` as verl sends them. Rows:

- ``text only``: the same model (tower included, idle) on samples of the same total length, every
  token text (``multi_modal_inputs`` None), one row per distinct length;
- per image configuration, ``tower trained`` (the default) and ``tower frozen``.

Every row runs in a fresh ``torchrun`` (``--worker``): one warm-up step on the row's batch, then
``--repeats`` steps, the last measured for memory; an image row's process also warms up and runs
``--repeats`` steps of the text batch of the same length on the same engine, alternating with its
own. ``step s`` = the fastest step's process CPU time (and the fastest wall time; one thread): on a
shared machine contention only adds time; ``x text`` (time) = that over the fastest text step of
the same process (both timed side by side, so a busy spell moves both); tokens/s = all tokens (text
+ visual) per CPU second; ``tower fwd s``: CPU time inside the tower's forward (fastest step; the
tower's backward is most of the rest of the trained row's extra time). ``peak MB``: VmHWM - RSS
around the last step with ``MALLOC_MMAP_THRESHOLD_=65536`` (CUDA: ``max_memory_allocated`` above
the allocated bytes); ``saved MB``: the activations autograd saved for backward in that step
(distinct non-parameter storages, ``saved_tensors_hooks``; exact); their ``x text``: over the text
row's (its own process) of the same length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_common import format_table, machine_header, measured_step, run_torchrun_worker

PATCH, MERGE, TEMPORAL = 14, 2, 2
# special tokens at the top of the vocab; text ids stay below them
SPECIAL = ("image", "video", "vision_start", "vision_end")


def parse_images(spec: str) -> list[tuple[int, int, int]]:
    """``"224:4,448x336:1"`` -> ``[(224, 224, 4), (448, 336, 1)]`` (height, width, images per sample);
    sides must be multiples of 28 (patch 14 x merge 2, so the processor keeps the size)."""
    out = []
    for item in spec.split(","):
        try:
            size, count = item.split(":")
            h, w = (int(s) for s in size.split("x")) if "x" in size else (int(size),) * 2
            n = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--images: {item!r} is not SIZE:COUNT or HxW:COUNT") from None
        unit = PATCH * MERGE
        if h <= 0 or w <= 0 or h % unit or w % unit or n <= 0:
            raise argparse.ArgumentTypeError(f"--images: {item!r} needs sides that are positive multiples "
                                             f"of {unit} and a count >= 1")
        out.append((h, w, n))
    return out


def visual_tokens(h: int, w: int) -> int:
    """Language-model tokens of one ``h x w`` image: ``(h / 14) (w / 14) / 2^2``."""
    return (h // PATCH) * (w // PATCH) // MERGE ** 2


def image_label(h: int, w: int, n: int) -> str:
    return f"{n} x {h}x{w}"


def special_ids(vocab: int) -> dict[str, int]:
    return {name: vocab - len(SPECIAL) + i for i, name in enumerate(SPECIAL)}


# ------------------------------------------------------------------------------------------- worker
def _vision_config(args: argparse.Namespace) -> dict:
    """The scaled-down Qwen2.5-VL ``vision_config`` (module docstring)."""
    return dict(depth=args.tower_depth, hidden_size=args.tower_hidden, intermediate_size=args.tower_ffn,
                num_heads=args.tower_heads, hidden_act="silu", out_hidden_size=args.hidden,
                patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3,
                window_size=112, fullatt_block_indexes=[args.tower_depth - 1], tokens_per_second=2)


def engine_config(args: argparse.Namespace, seq_len: int, freeze: bool):
    """One rank, fp32, thd, the whole batch one micro-batch."""
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig, VisionConfig

    ids = special_ids(args.vocab)
    pairs = args.hidden // args.heads // 2
    t = pairs // 4
    h = (pairs - t) // 2
    vision = VisionConfig(model_type="qwen2_5_vl", vision_config=_vision_config(args),
                          image_token_id=ids["image"], video_token_id=ids["video"],
                          vision_start_token_id=ids["vision_start"], mrope_section=[t, h, pairs - t - h],
                          mrope_interleaved=False, tokens_per_second=2)
    model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        num_query_groups=args.groups, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                        max_sequence_length=seq_len, rotary_base=1000000, add_qkv_bias=True,
                        norm_epsilon=1e-6, vision=vision, freeze_vision_tower=freeze)
    return EngineConfig(model=model, parallel=ParallelConfig(), optimizer=OptimizerConfig(lr=1e-5),
                        precision="fp32", micro_batch_size=args.samples, data_format="thd")


def make_batch(args: argparse.Namespace, image: tuple[int, int, int] | None, seed: int):
    """``--samples`` samples of ``--text-tokens`` text tokens around ``image``'s images (height, width,
    count per sample), or, for ``image=None``, of ``args.text_len`` text tokens each."""
    import numpy as np
    import torch
    from PIL import Image
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ids = special_ids(args.vocab)
    text_vocab = min(ids.values())
    words = lambda n: torch.randint(0, text_vocab, (n,), generator=g)  # noqa: E731
    rows, entries = [], []
    for _ in range(args.samples):
        if image is None:
            rows.append(words(args.text_len))
            entries.append(None)
            continue
        h, w, n = image
        pixels = h * w
        processor = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                             min_pixels=pixels, max_pixels=pixels)
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]
        out = processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        if grid.tolist() != [[1, h // PATCH, w // PATCH]] * n:
            raise RuntimeError(f"the image processor resized {h}x{w} to grid {grid.tolist()}")
        # text: the 2 n start / end tokens and words split evenly before, between and after the images
        free = args.text_tokens - 2 * n
        if free < n + 1:
            raise ValueError(f"--text-tokens {args.text_tokens} leaves no text around {n} images per sample "
                             f"(needs >= {3 * n + 1})")
        cuts = [free * i // (n + 1) for i in range(n + 2)]
        parts = [words(cuts[1] - cuts[0])]
        for i in range(n):
            parts += [torch.tensor([ids["vision_start"]]), torch.full((visual_tokens(h, w),), ids["image"]),
                      torch.tensor([ids["vision_end"]]), words(cuts[i + 2] - cuts[i + 1])]
        rows.append(torch.cat(parts))
        entries.append({"pixel_values": out["pixel_values"], "image_grid_thw": grid})
    nested = lambda t: torch.nested.nested_tensor(t, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nested(rows),
                        "advantages": nested([torch.randn(len(r), generator=g) for r in rows]),
                        "loss_mask": nested([torch.ones_like(r) for r in rows])}, batch_size=[len(rows)])
    batch["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries])
    return batch


def _loss(outputs, data, ctx):
    return (-data["advantages"] * outputs["log_probs"] * data["loss_mask"]).sum() / ctx.global_num_tokens, {}


def worker(kind: str, index: int, freeze: bool, args: argparse.Namespace) -> dict:
    """One rank: ``train_batch`` on the ``kind`` ("text" / "image") batch of image configuration
    ``index`` (module docstring); ``freeze``: ``model.freeze_vision_tower``. An image row also times
    the text batch of the same length on the same engine, alternating with its own steps."""
    import torch

    from mcore_engine import MegatronEngine

    image = args.images[index]
    h, w, n = image
    seq_len = args.text_tokens + n * visual_tokens(h, w)
    args.text_len = seq_len
    text = make_batch(args, None, seed=index)
    batch = text if kind == "text" else make_batch(args, image, seed=index)
    engine = MegatronEngine(engine_config(args, seq_len, freeze))
    engine.initialize()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    (chunk,) = engine.model
    tower = chunk.module.vision
    inside: list[float] = []  # CPU time in the tower's forward calls of one step
    tower.register_forward_pre_hook(lambda *_: inside.append(-time.process_time()))
    tower.register_forward_hook(lambda *_: inside.append(inside.pop() + time.process_time()))
    times: dict[int, dict[str, list[float]]] = {id(b): {"wall": [], "cpu": [], "tower": []}
                                                for b in (text, batch)}

    def run(b) -> None:
        sync()
        inside.clear()
        t, c = time.perf_counter(), time.process_time()
        engine.train_batch(b, _loss)
        sync()
        got = times[id(b)]
        got["wall"].append(time.perf_counter() - t)
        got["cpu"].append(time.process_time() - c)
        got["tower"].append(sum(inside))

    engine.train_batch(batch, _loss)  # warm-up
    if batch is not text:
        engine.train_batch(text, _loss)
    for _ in range(args.repeats - 1):
        if batch is not text:
            run(text)
        run(batch)
    if batch is not text:
        run(text)
    peak, saved_mb = measured_step(engine, lambda: run(batch))
    mine, same = times[id(batch)], times[id(text)]
    ids = torch.cat(list(batch["input_ids"].unbind(0)))
    visual = int((ids == engine.config.model.vision.image_token_id).sum())
    return {"kind": kind, "index": index, "freeze": freeze, "text_tokens": int(ids.numel()) - visual,
            "visual_tokens": visual, "wall_s": min(mine["wall"]), "cpu_s": min(mine["cpu"]),
            "tower_s": min(mine["tower"]), "text_cpu_s": min(same["cpu"]), "steps_cpu_s": mine["cpu"],
            "text_steps_cpu_s": same["cpu"], "peak_mb": peak, "saved_mb": saved_mb,
            "params": sum(p.numel() for p in chunk.module.parameters()),
            "tower_params": sum(p.numel() for p in tower.parameters()),
            "device": "cuda" if cuda else "cpu"}


# -------------------------------------------------------------------------------------------- table
COLUMNS = ["config", "tower", "tokens (text / visual)", "step s (cpu)", "x text", "step s (wall)",
           "tower fwd s (cpu)", "tokens/s", "peak MB", "x text", "saved MB", "x text"]


def row_plan(images: list[tuple[int, int, int]], text_tokens: int) -> list[tuple[str, int, bool]]:
    """``(kind, image index, freeze)`` of every row: a text row per distinct sample length (at its
    first image configuration), then each image configuration trained and frozen."""
    plan, lengths = [], set()
    for i, (h, w, n) in enumerate(images):
        length = text_tokens + n * visual_tokens(h, w)
        if length not in lengths:
            lengths.add(length)
            plan.append(("text", i, False))
    return plan + [("image", i, f) for i in range(len(images)) for f in (False, True)]


def table_rows(results: list[dict], images: list[tuple[int, int, int]]) -> list[list[str]]:
    """One row per result (in order): the time ratio against the text steps of the row's process, the
    memory ratios against the text row of the same total token count."""
    def total(r: dict) -> int:
        return r["text_tokens"] + r["visual_tokens"]

    text = {total(r): r for r in results if r["kind"] == "text"}
    rows = []
    for r in results:
        base = text[total(r)]
        if r["kind"] == "text":
            config, tower = "text only", "idle"
        else:
            config, tower = image_label(*images[r["index"]]), "frozen" if r["freeze"] else "trained"
        rows.append([config, tower, f"{r['text_tokens']} / {r['visual_tokens']}", f"{r['cpu_s']:.2f}",
                     f"{r['cpu_s'] / r['text_cpu_s']:.2f}", f"{r['wall_s']:.2f}", f"{r['tower_s']:.3f}",
                     f"{total(r) / r['cpu_s']:.0f}",
                     f"{r['peak_mb']:.1f}", f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}",
                     f"{r['saved_mb']:.1f}", f"{r['saved_mb'] / max(base['saved_mb'], 1e-9):.2f}"])
    return rows


# --------------------------------------------------------------------------------------------- main
def _positive(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=parse_images, default=parse_images("224:4,448:1"),
                   help="image configurations SIZE:COUNT or HxW:COUNT (images per sample), comma-separated")
    p.add_argument("--samples", type=_positive, default=4, help="samples in the batch (one micro-batch)")
    p.add_argument("--text-tokens", type=_positive, default=128,
                   help="non-image tokens per image sample (vision start / end included)")
    p.add_argument("--layers", type=_positive, default=6)
    p.add_argument("--hidden", type=_positive, default=512)
    p.add_argument("--heads", type=_positive, default=8, help="query heads (head dim = hidden / heads)")
    p.add_argument("--groups", type=_positive, default=2, help="key / value groups")
    p.add_argument("--ffn", type=_positive, default=1408, help="SwiGLU width")
    p.add_argument("--vocab", type=_positive, default=8192)
    p.add_argument("--tower-depth", type=_positive, default=4, help="tower blocks (the last: full attention)")
    p.add_argument("--tower-hidden", type=_positive, default=256)
    p.add_argument("--tower-heads", type=_positive, default=4)
    p.add_argument("--tower-ffn", type=_positive, default=688)
    p.add_argument("--repeats", type=_positive, default=2,
                   help="timed steps per row (the fastest reported, the last measured for memory)")
    p.add_argument("--quick", action="store_true", help="a tiny model and batch (seconds per row)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per row")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "INDEX", "FREEZE"), help=argparse.SUPPRESS)
    return p


QUICK = ["--images", "112:1", "--samples", "2", "--text-tokens", "16", "--layers", "2", "--hidden", "64",
         "--heads", "4", "--groups", "2", "--ffn", "128", "--vocab", "512", "--tower-depth", "2",
         "--tower-hidden", "32", "--tower-heads", "2", "--tower-ffn", "64", "--repeats", "1"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--quick" in argv:
        argv = QUICK + argv  # explicit flags after --quick's still win
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hidden % args.heads or (args.hidden // args.heads) % 2 or args.heads % args.groups:
        parser.error(f"--hidden {args.hidden} / --heads {args.heads} must be an even head dim and --groups "
                     f"{args.groups} must divide the heads")
    if args.tower_hidden % args.tower_heads:
        parser.error(f"--tower-heads {args.tower_heads} must divide --tower-hidden {args.tower_hidden}")
    worst = max(n for _, _, n in args.images)
    if args.text_tokens < 3 * worst + 1:
        parser.error(f"--text-tokens {args.text_tokens} leaves no text around {worst} images per sample "
                     f"(needs >= {3 * worst + 1})")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        kind, index, freeze = args.worker
        print("RESULT " + json.dumps(worker(kind, int(index), freeze == "frozen", args)), flush=True)
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
        return 0
    passthrough = [a for a in argv if a != "--markdown"]
    try:
        results = [run_torchrun_worker(__file__, 1, [*passthrough, "--worker", kind, str(i),
                                                     "frozen" if f else "trained"], args.timeout)
                   for kind, i, f in row_plan(args.images, args.text_tokens)]
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n".join(machine_header(extra=f", load avg {load:.1f}", packages=("transformers",))))
    r = next(r for r in results if r["kind"] == "image")
    print(f"\none train_batch, one rank, fp32, thd, {args.samples} samples in one micro-batch; "
          f"Qwen2.5-VL-shaped: LM {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.groups} kv groups), SwiGLU {args.ffn}, vocab {args.vocab}, sectioned mRoPE; tower "
          f"{args.tower_depth} blocks of "
          f"{args.tower_hidden} ({args.tower_heads} heads, MLP {args.tower_ffn}), windows of 112 px but the "
          f"last block (full attention), patch 14, merge 2; {r['params'] / 1e6:.2f}M params of which tower "
          f"{r['tower_params'] / 1e6:.2f}M; device {r['device']}; fastest of {args.repeats} step(s) after a "
          f"warm-up, tokens/s from CPU time; x text: time over the text steps of the same length in the "
          f"same process, memory over the text-only row")
    print(format_table(COLUMNS, table_rows(results, args.images), args.markdown, right=not args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
