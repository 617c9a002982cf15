"""The main job: pre-train a teacher GPT on the corpus, then distill it into a student on-policy.

Per data-parallel rank (both engines share the process groups)::

    x = corpus.sample(B, S)                                      # phase 1: [B, S]
    teacher.train_batch(lm_batch(x), next_token_loss)
    prompts = corpus.sample(B, P)                                # phase 2: [B, P]
    seqs = sample_continuations(student, prompts, G)             # [B, P + G]
    ids, lp = teacher_topk(teacher, seqs, k)                     # [B, P + G, k] each
    student.train_batch(distillation_batch(seqs, ids, lp), distillation_ppo_loss(),
                        logits_processor_func=make_forward_kl_topk(tail=...))

Metrics are summed over micro-batches and data-parallel ranks before they are logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml
from tensordict import TensorDict

from mcore_engine.losses import agg_loss, distillation_ppo_loss, make_forward_kl_topk
from mcore_engine.recipes.corpus import MarkovCorpus
from mcore_engine.recipes.job_config import DistillationConfig, JobConfig, TeacherTrainingConfig
from mcore_engine.recipes.logging import RunLogger, plot_curves
from mcore_engine.recipes.metrics import global_metrics, peak_memory_gib
from mcore_engine.recipes.sampling import GumbelMaxSampler, sample_continuations, teacher_topk

__all__ = ["JobSummary", "distill_student", "distillation_batch", "lm_batch", "next_token_loss", "run_job",
           "train_teacher"]


def next_token_loss(outputs: dict[str, torch.Tensor], data: TensorDict, ctx) -> tuple[torch.Tensor, dict]:
    """Teacher objective: ``agg_loss(-log_probs, loss_mask, seq_ids, "token-mean", ctx)``."""
    loss = agg_loss(-outputs["log_probs"], data["loss_mask"], data["seq_ids"], "token-mean", ctx)
    return loss, {"loss": loss.detach()}


def _padded_batch(tokens: torch.Tensor, micro_batch_size: int, **per_token: torch.Tensor) -> TensorDict:
    fields = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool), **per_token}
    batch = TensorDict(fields, batch_size=[tokens.shape[0]])
    batch.set_non_tensor("micro_batch_size_per_gpu", micro_batch_size)
    return batch


def lm_batch(tokens: torch.Tensor, micro_batch_size: int) -> TensorDict:
    """``tokens [B, S]`` -> engine batch for next-token training (every position but the last)."""
    return _padded_batch(tokens, micro_batch_size)


def distillation_batch(tokens: torch.Tensor, teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor, *,
                       prompt_len: int, micro_batch_size: int) -> TensorDict:
    """``tokens [B, S]`` + teacher top-k ``[B, S, k]`` -> distillation-only batch (``distillation_use_topk``,
    ``distillation_only``) with ``loss_mask[:, t] = t >= prompt_len - 1``."""
    loss_mask = torch.zeros_like(tokens, dtype=torch.float32)
    loss_mask[:, prompt_len - 1:] = 1.0
    batch = _padded_batch(tokens, micro_batch_size, loss_mask=loss_mask, teacher_ids=teacher_ids,
                          teacher_logprobs=teacher_log_probs)
    batch.set_non_tensor("distillation_use_topk", True)
    batch.set_non_tensor("distillation_only", True)
    return batch


def train_teacher(engine, corpus: MarkovCorpus, cfg: TeacherTrainingConfig, logger: RunLogger,
                  generator: torch.Generator, dp_size: int) -> list[float]:
    """Phase 1; returns the global loss per step."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    logger.start_phase("teacher", cfg.steps)
    losses = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        tokens = corpus.sample(cfg.batch_size, cfg.seq_len, generator)
        out = engine.train_batch(lm_batch(tokens, cfg.micro_batch_size), next_token_loss)
        engine.lr_scheduler_step()
        metrics = global_metrics(out, dp_group)
        seconds = time.perf_counter() - t0
        num_tokens = cfg.batch_size * cfg.seq_len * dp_size
        record = {"phase": "teacher", "step": step, **metrics, "tokens": num_tokens,
                  "tokens_per_s": num_tokens / seconds, "step_s": seconds, "mem_gib": peak_memory_gib()}
        losses.append(metrics["loss"])
        logger.log(record, {"loss": f"{metrics['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}",
                            "mem": f"{record['mem_gib']:.2f}G"})
    return losses


def distill_student(student, teacher, corpus: MarkovCorpus, cfg: DistillationConfig, logger: RunLogger,
                    generator: torch.Generator, sampler: GumbelMaxSampler, dp_size: int) -> list[dict]:
    """Phase 2; returns the global metrics per step."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    vocab_size = student.config.model.vocab_size
    loss_fn = distillation_ppo_loss(loss_agg_mode="token-mean")
    kl_processor = make_forward_kl_topk(tail=cfg.kl_tail, vocab_size=vocab_size)
    logger.start_phase("student", cfg.steps)
    history = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        prompts = corpus.sample(cfg.batch_size, cfg.prompt_len, generator)
        infer_mbs = cfg.inference_micro_batch_size
        seqs = sample_continuations(student, prompts, cfg.gen_len, sampler=sampler,
                                    temperature=cfg.temperature, micro_batch_size=infer_mbs)
        ids, log_probs = teacher_topk(teacher, seqs, cfg.top_k, micro_batch_size=infer_mbs)
        t1 = time.perf_counter()
        batch = distillation_batch(seqs, ids, log_probs, prompt_len=cfg.prompt_len,
                                   micro_batch_size=cfg.micro_batch_size)
        out = student.train_batch(batch, loss_fn, logits_processor_func=kl_processor)
        student.lr_scheduler_step()
        metrics = global_metrics(out, dp_group)
        t2 = time.perf_counter()
        num_tokens = seqs.numel() * dp_size
        record = {"phase": "student", "step": step, **metrics, "tokens": num_tokens,
                  "tokens_per_s": num_tokens / (t2 - t0), "rollout_s": t1 - t0, "train_s": t2 - t1,
                  "mem_gib": peak_memory_gib()}
        history.append(record)
        logger.log(record, {"kl": f"{metrics['distillation_loss']:.3f}",
                            "overlap": f"{metrics['topk_overlap']:.2f}",
                            "tok/s": f"{record['tokens_per_s']:.0f}", "mem": f"{record['mem_gib']:.2f}G"})
    return history


@dataclass(frozen=True)
class JobSummary:
    """What the job learned: first vs last values of the curves."""

    teacher_loss_first: float
    teacher_loss_last: float
    corpus_entropy_rate: float
    kl_first: float
    kl_last: float
    overlap_first: float
    overlap_last: float
    seconds: float
    run_dir: str

    def line(self) -> str:
        drop = 100.0 * (1.0 - self.kl_last / self.kl_first) if self.kl_first else 0.0
        return (f"teacher CE {self.teacher_loss_first:.3f} -> {self.teacher_loss_last:.3f} nats "
                f"(corpus floor {self.corpus_entropy_rate:.3f}) | student top-k KL {self.kl_first:.3f} -> "
                f"{self.kl_last:.3f} ({drop:.0f}% lower), top-k overlap {self.overlap_first:.2f} -> "
                f"{self.overlap_last:.2f} | {self.seconds:.0f} s | {self.run_dir}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_job(cfg: JobConfig) -> JobSummary:
    """Collective: phase 1, teacher checkpoint, phase 2, student checkpoint, ``curves.png`` in
    ``cfg.run_dir``; the summary's first/last values are means over ``min(3, steps)`` steps."""
    from megatron.core import parallel_state

    from mcore_engine import MegatronEngine

    start = time.perf_counter()
    corpus = MarkovCorpus(cfg.teacher.model.vocab_size, branching=cfg.corpus.branching,
                          zipf_exponent=cfg.corpus.zipf_exponent, seed=cfg.corpus.seed)
    teacher = MegatronEngine(cfg.teacher)
    teacher.initialize()                  # brings up torch.distributed and parallel_state
    logger = RunLogger(cfg.run_dir, enabled=dist.get_rank() == 0)
    try:
        if logger.enabled:
            with open(cfg.run_dir / "config.yaml", "w") as f:
                yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        generator = torch.Generator().manual_seed(cfg.corpus.seed * 7919 + 1 + dp_rank)
        teacher_losses = train_teacher(teacher, corpus, cfg.teacher_training, logger, generator, dp_size)
        teacher.save_checkpoint(str(cfg.run_dir / "checkpoints" / "teacher"))

        # Re-initialises parallel_state (same layout) and seeds the student's streams.
        student = MegatronEngine(cfg.student)
        student.initialize()
        sampler = GumbelMaxSampler(seed=cfg.student.seed * 7919 + dp_rank,
                                   vocab_size=cfg.student.model.vocab_size)
        history = distill_student(student, teacher, corpus, cfg.distillation, logger, generator, sampler,
                                  dp_size)
        student.save_checkpoint(str(cfg.run_dir / "checkpoints" / "student"))
    finally:
        logger.close()

    n_t, n_s = min(3, len(teacher_losses)), min(3, len(history))
    kls = [r["distillation_loss"] for r in history]
    overlaps = [r["topk_overlap"] for r in history]
    summary = JobSummary(
        teacher_loss_first=_mean(teacher_losses[:n_t]), teacher_loss_last=_mean(teacher_losses[-n_t:]),
        corpus_entropy_rate=corpus.entropy_rate(), kl_first=_mean(kls[:n_s]), kl_last=_mean(kls[-n_s:]),
        overlap_first=_mean(overlaps[:n_s]), overlap_last=_mean(overlaps[-n_s:]),
        seconds=time.perf_counter() - start, run_dir=str(cfg.run_dir))
    if logger.enabled:
        plot_curves(logger.metrics_path, cfg.run_dir / "curves.png",
                    teacher_floor=summary.corpus_entropy_rate)
    return summary
