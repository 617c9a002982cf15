"""GRPO on the engine's public API: a tiny policy learns the "count up" toy task (``toy_task.py``).

Per rollout step, on each data-parallel rank (G = ``group_size``, M = ``mini_batches``)::

    x = sample_prompts(n, P).repeat_interleave(G, 0)                 # [n G, P]: G copies per prompt
    seqs = sample_continuations(policy, x, R)                        # [n G, P + R], Gumbel-max sampling
    r = successor_reward(seqs, P, V)                                 # [n G] in [0, 1]
    A = (r - mean_group(r)) / (std_group(r) + eps)                   # verl's GRPO (unbiased std)
    old, H = policy.infer_batch(seqs)  -> log_probs, entropy          # behaviour log-probs (constants)
    ref = reference.log_probs(seqs)                                  # frozen initial policy (if KL)
    for each of the M contiguous mini-batches:                       # whole groups stay together
        policy.train_batch(mb, distillation_ppo_loss(clip..., kl_loss_coef, kl_loss_type))

Per-token fields are laid out like ``seqs`` ``[B, S]``; position t scores token t + 1, so the
response tokens are positions ``P - 1 .. S - 2`` (``loss_mask``), each carrying its sequence's A.
Logged per step (global rank 0, ``metrics.jsonl``): reward mean / std, KL to the reference (the
rollout policy's ``kl_loss_type`` estimate on the response tokens), the update's ``kl_loss``,
``pg_clipfrac``, ``ppo_kl``, entropy, tokens/s, memory. ``curves.png`` at the end.

The KL reference (:func:`build_reference`, the one place that decides): none when ``kl_loss_coef``
is 0; with LoRA (``policy.model.lora``) the policy engine itself under ``adapters_disabled()`` (the
frozen base: no second model, no weight copy; fresh adapters have B = 0, so it starts as the policy);
otherwise a second, ``forward_only`` engine built from the same seed (the initial weights).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import yaml
from tensordict import TensorDict

from mcore_engine.losses import distillation_ppo_loss, kl_estimator
from mcore_engine.recipes.grpo_config import GRPOConfig, GRPOJobConfig
from mcore_engine.recipes.logging import RunLogger, plot_grpo_curves
from mcore_engine.recipes.metrics import global_metrics, peak_memory_gib
from mcore_engine.recipes.sampling import GumbelMaxSampler, from_last_stage, sample_continuations
from mcore_engine.recipes.toy_task import sample_prompts, successor_reward

if TYPE_CHECKING:
    from mcore_engine import MegatronEngine

__all__ = ["GRPOSummary", "ReferencePolicy", "build_reference", "grpo_batch", "group_advantages",
           "response_mask", "run_grpo", "train_grpo"]


def group_advantages(rewards: torch.Tensor, group_size: int, epsilon: float = 1e-6) -> torch.Tensor:
    """``[n G]`` rewards (groups contiguous) -> ``[n G]`` float32 advantages, verl's GRPO::

        r = rewards.view(n, G);  A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + epsilon)

    ``std`` is unbiased (``torch.std``); G = 1 uses mean 0 and std 1 (verl). A group of equal
    rewards gets A = 0 exactly. Computed in float64.
    """
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating [N] tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be >= 1 and divide the {rewards.numel()} rewards, "
                         f"got {group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    r = rewards.double().view(-1, group_size)
    if group_size == 1:
        return rewards.float().clone()
    centred = r - r.mean(dim=1, keepdim=True)
    return (centred / (r.std(dim=1, keepdim=True) + epsilon)).reshape(-1).float()


def response_mask(shape: tuple[int, int], prompt_len: int) -> torch.Tensor:
    """float32 ``[B, S]``: 1 at positions ``prompt_len - 1 .. S - 2`` (those scoring response tokens)."""
    mask = torch.zeros(shape, dtype=torch.float32)
    mask[:, prompt_len - 1:shape[1] - 1] = 1.0
    return mask


def _padded_batch(tokens: torch.Tensor, *, temperature: float, micro_batch_size: int,
                  **per_token: torch.Tensor) -> TensorDict:
    fields = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool), **per_token}
    batch = TensorDict(fields, batch_size=[tokens.shape[0]])
    batch.set_non_tensor("temperature", temperature)
    batch.set_non_tensor("micro_batch_size_per_gpu", micro_batch_size)
    return batch


def grpo_batch(sequences: torch.Tensor, advantages: torch.Tensor, old_log_probs: torch.Tensor,
               ref_log_probs: torch.Tensor | None, *, prompt_len: int, temperature: float,
               micro_batch_size: int) -> TensorDict:
    """Engine batch of the policy update: ``sequences [B, S]``, per-sequence ``advantages [B]`` spread
    over the response positions, ``old_log_probs`` / ``ref_log_probs`` ``[B, S]`` (positions as the
    engine's outputs), ``loss_mask = response_mask``."""
    mask = response_mask(tuple(sequences.shape), prompt_len)
    fields = {"loss_mask": mask, "advantages": advantages.float()[:, None] * mask,
              "old_log_probs": old_log_probs.float()}
    if ref_log_probs is not None:
        fields["ref_log_probs"] = ref_log_probs.float()
    return _padded_batch(sequences, temperature=temperature, micro_batch_size=micro_batch_size, **fields)


def _token_outputs(engine: MegatronEngine, sequences: torch.Tensor, *, temperature: float,
                   micro_batch_size: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy or None) fp32 ``[B, S]`` of ``engine`` on ``sequences``, on every stage."""
    batch = _padded_batch(sequences, temperature=temperature, micro_batch_size=micro_batch_size)
    batch.set_non_tensor("calculate_entropy", entropy)
    out = engine.infer_batch(batch)
    shape = tuple(sequences.shape)
    log_probs = from_last_stage(out, "log_probs", shape, torch.float32).float().cpu()
    ent = from_last_stage(out, "entropy", shape, torch.float32).float().cpu() if entropy else None
    return log_probs, ent


@dataclass(frozen=True)
class ReferencePolicy:
    """The frozen policy of the KL term: ``engine`` (``adapters_off``: its LoRA adapters disabled)."""

    engine: MegatronEngine
    adapters_off: bool

    def log_probs(self, sequences: torch.Tensor, *, temperature: float,
                  micro_batch_size: int) -> torch.Tensor:
        """fp32 ``[B, S]`` log-probs of the reference on ``sequences`` (collective, like ``infer_batch``)."""
        off = self.engine.adapters_disabled() if self.adapters_off else contextlib.nullcontext()
        with off:
            return _token_outputs(self.engine, sequences, temperature=temperature,
                                  micro_batch_size=micro_batch_size, entropy=False)[0]


def build_reference(policy: MegatronEngine, cfg: GRPOJobConfig) -> ReferencePolicy | None:
    """Collective (after ``policy.initialize()``): the KL reference of the module docstring, or None
    when ``grpo.kl_loss_coef`` is 0."""
    if cfg.grpo.kl_loss_coef == 0:
        return None
    if cfg.policy.model.lora is not None:   # the frozen base under the adapters
        return ReferencePolicy(policy, adapters_off=True)
    from mcore_engine import MegatronEngine

    reference = MegatronEngine(cfg.reference_config())   # same seed, same layout: the initial weights
    reference.initialize()
    return ReferencePolicy(reference, adapters_off=False)


def _dp_sums(values: list[float], dp_group: dist.ProcessGroup | None) -> list[float]:
    """Elementwise sum of ``values`` over the data-parallel ranks (float64, one all-reduce)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return values
    packed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(packed, group=dp_group)
    return packed.tolist()


def train_grpo(policy: MegatronEngine, reference: ReferencePolicy | None, cfg: GRPOConfig, logger: RunLogger,
               generator: torch.Generator, sampler: GumbelMaxSampler, dp_size: int) -> list[dict]:
    """The rollout / update loop (module docstring); returns the logged record per step."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    vocab_size = policy.config.model.vocab_size
    loss_fn = distillation_ppo_loss(loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low,
                                    clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                                    kl_loss_coef=cfg.kl_loss_coef if reference is not None else 0.0,
                                    kl_loss_type=cfg.kl_loss_type)
    infer = dict(temperature=cfg.temperature, micro_batch_size=cfg.inference_micro_batch_size)
    num_rollouts = cfg.prompts_per_step * cfg.group_size
    mini = num_rollouts // cfg.mini_batches
    logger.start_phase("grpo", cfg.steps)
    history = []
    for step in range(cfg.steps):
        # --- 1. rollouts: G responses per prompt, rule-based rewards, group-normalised advantages ---
        t0 = time.perf_counter()
        prompts = sample_prompts(cfg.prompts_per_step, cfg.prompt_len, vocab_size, generator)
        grouped = prompts.repeat_interleave(cfg.group_size, dim=0)   # [n G, P]
        seqs = sample_continuations(policy, grouped, cfg.response_len, sampler=sampler, **infer)
        rewards = successor_reward(seqs, cfg.prompt_len, vocab_size)
        advantages = group_advantages(rewards, cfg.group_size, cfg.adv_epsilon)
        # --- 2. behaviour and reference log-probs (constants of the update) ---
        old, entropy = _token_outputs(policy, seqs, entropy=True, **infer)
        ref = reference.log_probs(seqs, **infer) if reference is not None else None
        t1 = time.perf_counter()
        # --- 3. M optimizer steps on contiguous mini-batches (whole groups) ---
        updates = []
        for m in range(cfg.mini_batches):
            rows = slice(m * mini, (m + 1) * mini)
            part = grpo_batch(seqs[rows], advantages[rows], old[rows], None if ref is None else ref[rows],
                              prompt_len=cfg.prompt_len, temperature=cfg.temperature,
                              micro_batch_size=cfg.micro_batch_size)
            updates.append(global_metrics(policy.train_batch(part, loss_fn), dp_group))
            policy.lr_scheduler_step()
        t2 = time.perf_counter()
        # --- 4. global statistics (sums over DP ranks) and the record ---
        mask = response_mask(tuple(seqs.shape), cfg.prompt_len)
        kl = kl_estimator(old, ref, cfg.kl_loss_type) if ref is not None else torch.zeros_like(old)
        groups = rewards.view(-1, cfg.group_size)
        equal_groups = groups.amax(1) == groups.amin(1)              # A = 0: no signal from the group
        sums = _dp_sums([float(rewards.double().sum()), float(rewards.double().square().sum()),
                         float(rewards.numel()), float((entropy * mask).double().sum()),
                         float((kl * mask).double().sum()), float(mask.double().sum()),
                         float(equal_groups.double().sum()), float(equal_groups.numel())], dp_group)
        n, mean = sums[2], sums[0] / sums[2]
        var = max(sums[1] / n - mean * mean, 0.0) * n / max(n - 1.0, 1.0)
        train = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        num_tokens = seqs.numel() * dp_size
        record = {"phase": "grpo", "step": step, "reward_mean": mean, "reward_std": var ** 0.5,
                  "entropy": sums[3] / sums[5], **({"kl": sums[4] / sums[5]} if ref is not None else {}),
                  "equal_reward_groups": sums[6] / sums[7], **train, "tokens": num_tokens,
                  "tokens_per_s": num_tokens / (t2 - t0), "rollout_s": t1 - t0, "train_s": t2 - t1,
                  "mem_gib": peak_memory_gib()}
        history.append(record)
        logger.log(record, {"reward": f"{mean:.3f}", "clip": f"{record['pg_clipfrac']:.3f}",
                            "tok/s": f"{record['tokens_per_s']:.0f}", "mem": f"{record['mem_gib']:.2f}G"})
    return history


@dataclass(frozen=True)
class GRPOSummary:
    """What the job learned: mean reward over the first and the last ``window`` steps."""

    reward_first: float
    reward_last: float
    chance: float
    window: int
    seconds: float
    run_dir: str

    def line(self) -> str:
        return (f"mean reward {self.reward_first:.3f} -> {self.reward_last:.3f} (first / last "
                f"{self.window} steps; uniform policy {self.chance:.3f}, perfect 1) | {self.seconds:.0f} s | "
                f"{self.run_dir}")


def run_grpo(cfg: GRPOJobConfig) -> GRPOSummary:
    """Collective: build the policy (+ reference: :func:`build_reference`), train, write ``metrics.jsonl``,
    ``config.yaml`` and ``curves.png`` in ``cfg.run_dir``; the summary averages ``min(5, steps)`` steps
    at each end."""
    from megatron.core import parallel_state

    from mcore_engine import MegatronEngine

    start = time.perf_counter()
    policy = MegatronEngine(cfg.policy)
    policy.initialize()                   # brings up torch.distributed and parallel_state
    reference = build_reference(policy, cfg)
    logger = RunLogger(cfg.run_dir, enabled=dist.get_rank() == 0)
    try:
        if logger.enabled:
            with open(cfg.run_dir / "config.yaml", "w") as f:
                yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        generator = torch.Generator().manual_seed(cfg.grpo.seed * 7919 + 1 + dp_rank)
        sampler = GumbelMaxSampler(seed=cfg.policy.seed * 7919 + dp_rank,
                                   vocab_size=cfg.policy.model.vocab_size)
        history = train_grpo(policy, reference, cfg.grpo, logger, generator, sampler, dp_size)
    finally:
        logger.close()
    window = min(5, len(history))
    rewards = [r["reward_mean"] for r in history]
    chance = 1.0 / cfg.policy.model.vocab_size
    summary = GRPOSummary(reward_first=sum(rewards[:window]) / window,
                          reward_last=sum(rewards[-window:]) / window, chance=chance, window=window,
                          seconds=time.perf_counter() - start, run_dir=str(cfg.run_dir))
    if logger.enabled:
        plot_grpo_curves(logger.metrics_path, cfg.run_dir / "curves.png", chance=chance)
    return summary
