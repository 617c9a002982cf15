"""The main job: corpus, job config, sampling processors (1 and 2 gloo ranks), losses/batches of the
recipe, the plot, and one end-to-end ``torchrun tools/train.py`` run on 2 ranks (TP=2)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from mcore_engine.losses import LossContext
from mcore_engine.recipes import JobConfig, MarkovCorpus
from mcore_engine.recipes.distill import distillation_batch, lm_batch, next_token_loss
from mcore_engine.recipes.logging import RunLogger, plot_curves, read_metrics
from mcore_engine.recipes.sampling import GumbelMaxSampler, topk_processor
from mcore_engine.state.checkpoint import FORMAT
from tests.utils import assert_rel_close, run_distributed

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "configs" / "demo_tiny_tp2.yaml"


# ----------------------------------------------------------------------------------------------- corpus
def test_markov_corpus_table_samples_and_entropy_rate():
    corpus = MarkovCorpus(37, branching=5, zipf_exponent=1.3, seed=3)
    p = corpus.transition_matrix()
    assert p.shape == (37, 37)
    torch.testing.assert_close(p.sum(-1), torch.ones(37, dtype=torch.float64), rtol=0, atol=1e-12)
    assert ((p > 0).sum(-1) == 5).all()
    assert torch.equal(p, MarkovCorpus(37, branching=5, zipf_exponent=1.3, seed=3).transition_matrix())
    assert not torch.equal(p, MarkovCorpus(37, branching=5, zipf_exponent=1.3, seed=4).transition_matrix())

    x = corpus.sample(64, 300, torch.Generator().manual_seed(0))
    assert x.shape == (64, 300) and x.dtype == torch.int64
    probs = p[x[:, :-1], x[:, 1:]]
    assert (probs > 0).all(), "a sampled transition lies outside the chain's support"
    # Empirical cross-entropy of the chain on its own samples ~ the entropy rate.
    empirical = float(-probs.log().mean())
    assert abs(empirical - corpus.entropy_rate()) < 0.02 * corpus.entropy_rate()
    # Float64 reference: stationary mix of the rows' entropies (power iteration on the dense table).
    pi = torch.full((37,), 1 / 37, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ p
    row_entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert math.isclose(corpus.entropy_rate(), float(pi @ row_entropy), rel_tol=1e-9)
    # Which successor slot j each transition took: pooled frequencies follow the Zipf weights.
    slot = (corpus.successors[x[:, :-1]] == x[:, 1:, None]).double().argmax(-1)
    freq = torch.bincount(slot.reshape(-1), minlength=5).double() / slot.numel()
    assert float((freq - corpus.weights).abs().max()) < 0.02, (freq, corpus.weights)
    flat = MarkovCorpus(20, branching=4, zipf_exponent=0.0, seed=1)
    assert math.isclose(flat.entropy_rate(), math.log(4), rel_tol=1e-12)
    assert math.isclose(flat.uniform_entropy, math.log(20))


@pytest.mark.parametrize("kwargs", [dict(vocab_size=1, branching=1), dict(vocab_size=10, branching=11),
                                    dict(vocab_size=10, branching=0)])
def test_markov_corpus_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="vocab_size|branching"):
        MarkovCorpus(kwargs["vocab_size"], branching=kwargs["branching"], zipf_exponent=1.0, seed=0)


# ----------------------------------------------------------------------------------------------- config
def _demo_dict() -> dict:
    with open(DEMO_CONFIG) as f:
        return yaml.safe_load(f)


def test_job_config_loads_demo_and_applies_overrides():
    cfg = JobConfig.from_yaml(DEMO_CONFIG, ["distillation.steps=7", "student.optimizer.lr=3e-3", "name=x"])
    assert cfg.distillation.steps == 7 and cfg.student.optimizer.lr == 3e-3 and cfg.name == "x"
    assert cfg.teacher.parallel.tensor_model_parallel_size == 2
    assert cfg.run_dir == Path("runs") / "x"
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    # the demo's sizes: a padded vocab and top-k below the chain's branching (the tail term matters)
    assert cfg.student.model.vocab_size % 256 != 0 and cfg.distillation.top_k < cfg.corpus.branching


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("demo_*.yaml")), ids=lambda p: p.name)
def test_every_demo_config_loads(path):
    cfg = JobConfig.from_yaml(path)
    world = 8 if "gpu_8x" in path.name else 2
    assert cfg.teacher.validate_world_size(world) >= 1
    corpus = MarkovCorpus(cfg.student.model.vocab_size, branching=cfg.corpus.branching,
                          zipf_exponent=cfg.corpus.zipf_exponent, seed=cfg.corpus.seed)
    assert corpus.entropy_rate() < corpus.uniform_entropy - 1.0        # a chain worth learning


@pytest.mark.parametrize("overrides, match", [
    (["student.model.vocab_size=300"], "vocab_size"),
    (["student.parallel.tensor_model_parallel_size=1"], "parallel"),
    (["distillation.gen_len=200"], "max_sequence_length"),
    (["teacher_training.seq_len=1"], "seq_len"),
    (["distillation.top_k=0"], "top_k"),
    (["distillation.temperature=0"], "temperature"),
    (["corpus.branching=400"], "branching"),
    (["distillation.bogus=1"], "bogus"),
    (["name=a/b"], "name"),
    (["student.model.fused_lm_head=true"], "fused_lm_head"),
    (["distillation.steps"], "dotted.key=value"),
])
def test_job_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        JobConfig.from_yaml(DEMO_CONFIG, overrides)


def test_job_config_requires_both_engines():
    d = _demo_dict()
    del d["student"]
    with pytest.raises(ValueError, match="student"):
        JobConfig.from_dict(d)


# ----------------------------------------------------------------------------------------------- batches
def test_next_token_loss_matches_float64_token_mean():
    g = torch.Generator().manual_seed(11)
    n = 23
    log_probs = -torch.rand(n, generator=g) * 5
    mask = (torch.rand(n, generator=g) > 0.3).float()
    ctx = LossContext(global_num_tokens=mask.sum() * 3, global_num_seqs=torch.tensor(4.0), dp_size=1,
                      distillation_only=False)
    loss, metrics = next_token_loss({"log_probs": log_probs.requires_grad_()},
                                    {"loss_mask": mask, "seq_ids": torch.zeros(n, dtype=torch.int64)}, ctx)
    expected = -(log_probs.double() * mask.double()).sum() / (mask.double().sum() * 3)
    assert_rel_close(loss, expected, 1e-6, "next_token_loss")
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert_rel_close(grad, -mask.double() / (mask.double().sum() * 3), 1e-6, "d next_token_loss")
    assert float(metrics["loss"]) == float(loss)


def test_recipe_batches():
    tokens = torch.randint(0, 50, (3, 9))
    lm = lm_batch(tokens, 2)
    assert torch.equal(lm["input_ids"], tokens) and bool(lm["attention_mask"].all())
    assert lm.get_non_tensor("micro_batch_size_per_gpu") == 2
    ids = torch.randint(0, 50, (3, 9, 4))
    lp = -torch.rand(3, 9, 4)
    batch = distillation_batch(tokens, ids, lp, prompt_len=4, micro_batch_size=2)
    expected_mask = torch.zeros(3, 9)
    expected_mask[:, 3:] = 1
    assert torch.equal(batch["loss_mask"], expected_mask)
    assert torch.equal(batch["teacher_ids"], ids) and torch.equal(batch["teacher_logprobs"], lp)
    assert batch.get_non_tensor("distillation_use_topk") is True
    assert batch.get_non_tensor("distillation_only") is True


# ----------------------------------------------------------------------------------------------- sampling
def _sample_frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1), minlength=vocab).double() / ids.numel()


def test_gumbel_sampler_single_shard_matches_softmax():
    vocab, true_vocab, rows = 13, 11, 40000                     # ids 11, 12 are padding
    g = torch.Generator().manual_seed(5)
    row_logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    logits = row_logits.float().expand(rows, vocab).reshape(2, rows // 2, vocab).contiguous()
    before = logits.clone()
    sampler = GumbelMaxSampler(seed=1, vocab_size=true_vocab)
    ids = sampler(logits)["sampled_ids"]
    assert ids.shape == (2, rows // 2) and ids.dtype == torch.int64
    assert torch.equal(logits, before), "the sampler modified its input"
    freq = _sample_frequencies(ids, vocab)
    expected = torch.cat([row_logits[:true_vocab].softmax(-1), torch.zeros(2, dtype=torch.float64)])
    assert float((freq - expected).abs().max()) < 0.01, (freq, expected)
    assert float(freq[true_vocab:].sum()) == 0.0, "a padded id was sampled"
    again = GumbelMaxSampler(seed=1, vocab_size=true_vocab)(logits)["sampled_ids"]
    assert torch.equal(again, ids), "same seed and call index must give the same draw"
    assert not torch.equal(sampler(logits)["sampled_ids"], ids), "the second call must draw fresh noise"


def _tp2_sampling_checks(rank: int, world_size: int) -> None:
    vocab, true_vocab, rows = 14, 13, 12000
    g = torch.Generator().manual_seed(8)                         # same logits on both ranks
    full = torch.randn(rows, vocab, generator=g) * 2
    shard = full[:, rank * vocab // 2:(rank + 1) * vocab // 2].contiguous()
    group = dist.group.WORLD
    # --- 1. Gumbel-max: identical ids on both ranks, distributed as softmax over the true vocab ---
    ids = GumbelMaxSampler(seed=3, vocab_size=true_vocab, group=group)(shard)["sampled_ids"]
    gathered = [torch.empty_like(ids) for _ in range(world_size)]
    dist.all_gather(gathered, ids)
    assert torch.equal(gathered[0], gathered[1]), "TP ranks sampled different tokens"
    assert int(ids.max()) < true_vocab
    # per-row distributions differ: compare the mean probability of the sampled ids' bins
    p = full.double()[:, :true_vocab].softmax(-1)
    hist = torch.bincount(ids, minlength=vocab).double()[:true_vocab] / rows
    assert float((hist - p.mean(0)).abs().max()) < 0.02          # ~4 standard errors
    # --- 2. teacher top-k processor == float64 top-k of the gathered logits ---
    k = 5
    logits = shard.reshape(3, rows // 3, -1)[:, :7]
    out = topk_processor(k, vocab_size=true_vocab, group=group)(logits)
    ref = full.double().reshape(3, rows // 3, -1)[:, :7, :true_vocab].log_softmax(-1).topk(k)
    assert torch.equal(out["topk_ids"], ref.indices)
    assert_rel_close(out["topk_log_probs"], ref.values, 1e-5, "topk_log_probs")


def test_sampling_processors_tp2():
    run_distributed(_tp2_sampling_checks, 2)


# ----------------------------------------------------------------------------------------------- logging
def test_run_logger_and_plot(tmp_path):
    logger = RunLogger(tmp_path / "run", enabled=True)
    logger.start_phase("teacher", 3)
    for step in range(3):
        logger.log({"phase": "teacher", "step": step, "loss": 5.0 - step}, {"loss": f"{5.0 - step:.1f}"})
    logger.start_phase("student", 2)
    for step in range(2):
        logger.log({"phase": "student", "step": step, "distillation_loss": 1.0 / (step + 1),
                    "topk_overlap": 0.1 * step, "student_mass": 0.2, "teacher_mass": 0.8})
    logger.close()
    records = read_metrics(logger.metrics_path)
    assert [r["phase"] for r in records] == ["teacher"] * 3 + ["student"] * 2
    png = tmp_path / "run" / "curves.png"
    plot_curves(logger.metrics_path, png, teacher_floor=2.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    silent = RunLogger(tmp_path / "other", enabled=False)
    silent.log({"phase": "teacher"})
    silent.close()
    assert not (tmp_path / "other").exists()


# ----------------------------------------------------------------------------------------------- end to end
_LAYOUTS = {"tp2": [], "pp2": [f"{who}.parallel.{key}={size}" for who in ("teacher", "student")
                              for key, size in (("tensor_model_parallel_size", 1),
                                                ("pipeline_model_parallel_size", 2))]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_main_job_end_to_end(tmp_path, layout):
    """``torchrun --nproc_per_node=2 tools/train.py`` with tiny sizes (TP=2, or PP=2 where rollouts
    and teacher top-k come from the last stage): outputs appear, the KL falls."""
    overrides = [  # vocab 61 (padded to 256 under TP=2): a chain the teacher learns in 20 small steps
        "name=e2e", f"output_dir={tmp_path}", "teacher.model.vocab_size=61", "student.model.vocab_size=61",
        "corpus.branching=6", "teacher_training.steps=20", "teacher_training.seq_len=32",
        "teacher_training.batch_size=8", "teacher.optimizer.lr=1e-2", "teacher.optimizer.lr_warmup_steps=2",
        "teacher.optimizer.lr_decay_steps=20", "distillation.steps=10", "distillation.batch_size=32",
        "distillation.gen_len=8", "distillation.top_k=4", "distillation.micro_batch_size=16",
        "distillation.inference_micro_batch_size=32", "student.optimizer.lr=2e-2",
        "student.optimizer.lr_warmup_steps=0", "student.optimizer.lr_decay_steps=10", *_LAYOUTS[layout],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "tools/train.py"), *overrides]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("summary: ") == 1, proc.stdout[-2000:]

    run = tmp_path / "e2e"
    records = read_metrics(run / "metrics.jsonl")
    teacher = [r for r in records if r["phase"] == "teacher"]
    student = [r for r in records if r["phase"] == "student"]
    assert len(teacher) == 20 and len(student) == 10
    for r in records:
        assert r["tokens_per_s"] > 0 and r["mem_gib"] > 0 and math.isfinite(r["grad_norm"])
    ce = [r["loss"] for r in teacher]
    assert sum(ce[-3:]) / 3 < sum(ce[:3]) / 3 - 1.0, ce
    kl = [r["distillation_loss"] for r in student]
    assert all(math.isfinite(v) and v >= 0 for v in kl)           # k+1-bucket KL is a proper KL
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl
    assert "log_probs" not in student[0] and "topk_overlap" in student[0]
    assert (run / "curves.png").stat().st_size > 10_000
    assert (run / "config.yaml").is_file()
    for who in ("teacher", "student"):
        ckpt = run / "checkpoints" / who
        marker = json.loads((ckpt / "mcore_engine.json").read_text())
        assert marker["format"] == FORMAT and marker["layout"]["world_size"] == 2, marker
        assert list(ckpt.glob("*.distcp")), sorted(p.name for p in ckpt.iterdir())
