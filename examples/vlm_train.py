"""A vision-language model in the engine: images in the batch as verl sends them, one PPO update at
TP=2, the exported folder back in transformers. Run (a tiny random Qwen2.5-VL folder first):

    python -c "from tests.hf.vlm_models import *; tiny_vlm_folder('qwen2_5_vl', 'build/tiny_vl')"
    torchrun --standalone --nproc_per_node=2 examples/vlm_train.py build/tiny_vl build/tiny_vl_out
"""

import dataclasses
import sys

import numpy as np
import torch
import transformers
from PIL import Image
from tensordict import NonTensorData, NonTensorStack, TensorDict

from mcore_engine import EngineConfig, MegatronEngine
from mcore_engine.config import ParallelConfig
from mcore_engine.hf import from_hf_config, read_hf_config
from mcore_engine.losses import distillation_ppo_loss

folder, out_dir = sys.argv[1], sys.argv[2]
hf = read_hf_config(folder)
model = dataclasses.replace(from_hf_config(hf), hf_path=folder)              # ModelConfig.vision filled
engine = MegatronEngine(EngineConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=2,
                                                                          sequence_parallel=True)))
engine.initialize()

processor = transformers.AutoImageProcessor.from_pretrained(folder)         # PIL backend without torchvision
rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)         # same rollouts on both TP ranks
ids, media = [], []
for sizes in ([(56, 84)], [], [(112, 56), (56, 56)]):                        # images (h, w) per sample
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    inputs = processor(images=images, return_tensors="pt") if images else None
    tokens = [torch.randint(3, 200, (5,), generator=g)]
    for t, h, w in ([] if inputs is None else inputs["image_grid_thw"].tolist()):  # the processor's expansion
        pads = torch.full((t * h * w // 4,), hf["image_token_id"])                # merge 2 x 2
        start, end = torch.tensor([hf["vision_start_token_id"]]), torch.tensor([hf["vision_end_token_id"]])
        tokens += [start, pads, end]
    ids.append(torch.cat([*tokens, torch.randint(3, 200, (7,), generator=g)]))  # + the response
    media.append(None if inputs is None else {k: inputs[k] for k in ("pixel_values", "image_grid_thw")})
advantages = [torch.randn(len(x), generator=g) for x in ids]
batch = TensorDict({"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                    "advantages": torch.nested.as_nested_tensor(advantages, layout=torch.jagged)},
                   batch_size=[len(ids)])
batch["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(m) for m in media])  # verl's per-sample field
batch.set_non_tensor("temperature", 1.0)

batch["old_log_probs"] = engine.infer_batch(batch)["log_probs"]               # 3-D positions: the engine's
out = engine.train_batch(batch, distillation_ppo_loss(loss_agg_mode="token-mean", clip_ratio_c=3.0))
engine.export_hf(out_dir)                                                    # the tower too, folder names
if torch.distributed.get_rank() == 0:
    print("loss", float(out.get_non_tensor("loss")), "grad_norm", out.get_non_tensor("metrics")["grad_norm"])
    cls = getattr(transformers, hf["architectures"][0])
    reloaded = cls.from_pretrained(out_dir)
    print("exported", type(reloaded).__name__, sum(p.numel() for p in reloaded.parameters()), "parameters")
