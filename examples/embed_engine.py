"""How an RL framework embeds the engine: one PPO update on a TensorDict batch of variable-length
sequences. Run: torchrun --standalone --nproc_per_node=2 examples/embed_engine.py [engine config]
(default configs/tiny_cpu_tp2.yaml; configs/tiny_cpu_qwen3_5.yaml: the Qwen3.5-style hybrid;
configs/tiny_cpu_gpt_oss.yaml: gpt-oss-style sinks, windows and clamped-GLU MoE)"""

import sys

import torch
from tensordict import TensorDict

from mcore_engine import EngineConfig, MegatronEngine
from mcore_engine.losses import distillation_ppo_loss

config = sys.argv[1] if len(sys.argv) > 1 else "configs/tiny_cpu_tp2.yaml"
engine = MegatronEngine(EngineConfig.from_yaml(config))               # TP=2, vocab 250
engine.initialize()                                                  # torch.distributed, model, optimizer

g = torch.Generator().manual_seed(0)                                 # same rollouts on both TP ranks
lengths = (9, 14, 5, 11)                                             # prompt + response tokens
ids = [torch.randint(0, 250, (n,), generator=g) for n in lengths]
advantages = [torch.randn(n, generator=g) for n in lengths]
batch = TensorDict({"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                    "advantages": torch.nested.as_nested_tensor(advantages, layout=torch.jagged)},
                   batch_size=[len(lengths)])
batch.set_non_tensor("temperature", 1.0)
batch.set_non_tensor("micro_batch_size_per_gpu", 2)

old = engine.infer_batch(batch)["log_probs"]                         # behaviour log-probs, jagged [4, j]
batch["old_log_probs"] = old
out = engine.train_batch(batch, distillation_ppo_loss(loss_agg_mode="token-mean", clip_ratio_c=3.0))
engine.lr_scheduler_step()
if torch.distributed.get_rank() == 0:
    print("loss", float(out.get_non_tensor("loss")), "grad_norm", out.get_non_tensor("metrics")["grad_norm"])
