"""The GRPO recipe: the toy reward, the group advantages, the update batch and the job config
(in-process, float64 references), and short ``run_grpo`` jobs on 2 gloo ranks (TP=2): full
fine-tuning (outputs, per-group advantages, reference engine, learning) and LoRA (one engine, the
reference log-probs those of the base model, the base bit-identical, only the adapters trained,
learning)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from mcore_engine.recipes.grpo import group_advantages, grpo_batch, response_mask
from mcore_engine.recipes.grpo_config import GRPOJobConfig
from mcore_engine.recipes.logging import read_metrics
from mcore_engine.recipes.toy_task import sample_prompts, successor_reward
from tests.utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
GRPO_CONFIG = ROOT / "configs" / "grpo_tiny_tp2.yaml"
GRPO_LORA_CONFIG = ROOT / "configs" / "grpo_tiny_lora_tp2.yaml"


# ----------------------------------------------------------------------------------------- references
def _reference_reward(row: list[int], prompt_len: int, vocab: int) -> float:
    """Python loop: the fraction of response steps with ``y_i == (y_{i-1} + 1) % V``."""
    tail = row[prompt_len - 1:]
    return sum(tail[i] == (tail[i - 1] + 1) % vocab for i in range(1, len(tail))) / (len(tail) - 1)


def _reference_advantages(rewards: list[float], group_size: int, eps: float) -> list[float]:
    """verl's ``compute_grpo_outcome_advantage`` in Python floats (unbiased std per group)."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        out += [(r - mean) / (std + eps) for r in group]
    return out


# ----------------------------------------------------------------------------------------- reward
def test_successor_reward_values():
    v, p = 7, 3
    seqs = torch.tensor([[0, 1, 5, 6, 0, 1, 2],      # counts up through the wrap 6 -> 0: 1
                         [0, 1, 5, 3, 3, 3, 3],      # never: 0
                         [2, 2, 2, 3, 4, 0, 1],      # 3, 4 ok; 4 -> 0 wrong; 0 -> 1 ok: 3/4
                         [4, 4, 6, 1, 2, 3, 4]])     # 6 -> 1 wrong, then 1 -> 2 -> 3 -> 4: 3/4
    before = seqs.clone()
    r = successor_reward(seqs, p, v)
    assert r.dtype == torch.float32 and torch.equal(seqs, before)
    assert r.tolist() == [1.0, 0.0, 0.75, 0.75]
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(0, 11, (64, 9), generator=g)
    expected = [_reference_reward(row, 4, 11) for row in rand.tolist()]
    assert successor_reward(rand, 4, 11).double().tolist() == pytest.approx(expected, abs=1e-7)
    # a uniform policy scores 1 / V on average
    big = sample_prompts(4000, 10, 11, torch.Generator().manual_seed(0))
    assert abs(float(successor_reward(big, 2, 11).mean()) - 1 / 11) < 0.005
    assert big.min() >= 0 and big.max() < 11 and big.dtype == torch.int64


@pytest.mark.parametrize("args, match", [((torch.zeros(3, 4, dtype=torch.int64), 4, 5), "prompt_len"),
                                         ((torch.zeros(3, 4, dtype=torch.int64), 0, 5), "prompt_len"),
                                         ((torch.zeros(3, 4), 2, 5), "int64"),
                                         ((torch.zeros(4, dtype=torch.int64), 2, 5), "int64")])
def test_successor_reward_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        successor_reward(*args)


# ----------------------------------------------------------------------------------------- advantages
def test_group_advantages_match_float64_reference():
    g = torch.Generator().manual_seed(7)
    group_size, eps = 5, 1e-6
    rewards = torch.rand(6 * group_size, generator=g).round(decimals=2)
    rewards[10:15] = 0.25                                        # one group of equal rewards
    before = rewards.clone()
    adv = group_advantages(rewards, group_size, eps)
    assert torch.equal(rewards, before) and adv.dtype == torch.float32 and torch.isfinite(adv).all()
    expected = _reference_advantages(rewards.double().tolist(), group_size, eps)
    assert adv.double().tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert torch.equal(adv[10:15], torch.zeros(5)), "a group of equal rewards must get A = 0 exactly"
    groups = adv.double().view(-1, group_size)
    assert groups.sum(1).abs().max() < 1e-5                     # centred within each group
    informative = [i for i in range(6) if i != 2]
    assert torch.allclose(groups[informative].std(1), torch.ones(5, dtype=torch.float64), atol=1e-4)


def test_group_advantages_edge_cases():
    zeros = group_advantages(torch.zeros(8), 4)                  # every group equal: no signal, no NaN
    assert torch.equal(zeros, torch.zeros(8))
    assert group_advantages(torch.tensor([0.0, 1.0]), 2).tolist() == pytest.approx(
        [-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)])   # unbiased std
    assert group_advantages(torch.tensor([0.3, 0.7]), 1).tolist() == pytest.approx([0.3, 0.7])   # verl: G=1
    for bad, match in ((torch.zeros(5), "divide"), (torch.zeros(2, 2), "\\[N\\]"),
                       (torch.tensor([0.0, float("nan")]), "finite"),
                       (torch.zeros(4, dtype=torch.int64), "float")):
        with pytest.raises(ValueError, match=match):
            group_advantages(bad, 2)


def test_grpo_batch_fields():
    seqs = torch.randint(0, 9, (4, 7))
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    old, ref = -torch.rand(4, 7), -torch.rand(4, 7)
    batch = grpo_batch(seqs, adv, old, ref, prompt_len=3, temperature=0.7, micro_batch_size=2)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0], dtype=torch.float32).expand(4, 7)   # positions P-1 .. S-2
    assert torch.equal(response_mask((4, 7), 3), mask) and torch.equal(batch["loss_mask"], mask)
    assert torch.equal(batch["advantages"], adv[:, None] * mask)
    assert torch.equal(batch["old_log_probs"], old) and torch.equal(batch["ref_log_probs"], ref)
    assert torch.equal(batch["input_ids"], seqs) and bool(batch["attention_mask"].all())
    assert batch.get_non_tensor("temperature") == 0.7
    assert batch.get_non_tensor("micro_batch_size_per_gpu") == 2
    assert "ref_log_probs" not in grpo_batch(seqs, adv, old, None, prompt_len=3, temperature=1.0,
                                             micro_batch_size=2).keys()


# ----------------------------------------------------------------------------------------- config
def test_grpo_config_loads_and_rejects():
    cfg = GRPOJobConfig.from_yaml(GRPO_CONFIG, ["grpo.steps=3", "name=x"])
    assert cfg.grpo.steps == 3 and cfg.run_dir == Path("runs") / "x"
    assert cfg.policy.parallel.tensor_model_parallel_size == 2 and cfg.policy.validate_world_size(2) == 1
    assert GRPOJobConfig.from_dict(cfg.to_dict()) == cfg
    ref = cfg.reference_config()
    assert ref.forward_only and not cfg.policy.forward_only and ref.seed == cfg.policy.seed
    lora = GRPOJobConfig.from_yaml(GRPO_LORA_CONFIG)
    assert lora.policy.model.lora.rank == 16 and lora.policy.model.lora.target_modules == "all-linear"
    assert GRPOJobConfig.from_dict(lora.to_dict()) == lora
    assert lora.grpo == GRPOJobConfig.from_yaml(GRPO_CONFIG).grpo, "the LoRA recipe runs the same GRPO"
    for overrides, match in ((["grpo.group_size=1"], "group_size"), (["grpo.mini_batches=3"], "mini_batches"),
                             (["grpo.response_len=40"], "max_sequence_length"),
                             (["grpo.loss_agg_mode=sum"], "loss_agg_mode"),
                             (["grpo.kl_loss_type=k2"], "kl_loss_type"),
                             (["grpo.bogus=1"], "bogus"), (["policy.forward_only=true"], "forward_only"),
                             (["policy.model.fused_lm_head=true"], "fused_lm_head")):
        with pytest.raises(ValueError, match=match):
            GRPOJobConfig.from_yaml(GRPO_CONFIG, overrides)


# ----------------------------------------------------------------------------------------- end to end
# vocab 7 (padded to 16 under TP=2) and lr 1e-2: chance 1/7; measured over 4 seeds, the mean reward of
# the last 3 of 16 steps is 0.59-0.75 against 0.14-0.18 for the first 3 (about 8 s of training).
_E2E = ["name=e2e", "grpo.steps=16", "grpo.prompts_per_step=8", "grpo.group_size=8", "grpo.prompt_len=3",
        "grpo.response_len=5", "grpo.mini_batches=2", "grpo.micro_batch_size=32",
        "grpo.inference_micro_batch_size=64", "policy.model.vocab_size=7", "policy.optimizer.lr=1e-2",
        "policy.optimizer.lr_warmup_steps=0", "policy.optimizer.lr_decay_style=constant"]


def _grpo_job(rank: int, world_size: int, out_dir: str) -> None:
    from mcore_engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.recipes.grpo import run_grpo

    cfg = GRPOJobConfig.from_yaml(GRPO_CONFIG, [*_E2E, f"output_dir={out_dir}"])
    seen: list[dict[str, torch.Tensor]] = []                     # the batch fields of each train call
    original = MegatronEngine.train_batch

    def spy(self, batch, *args, **kwargs):                       # records what the recipe hands the engine
        seen.append({k: batch[k].clone() for k in ("input_ids", "advantages", "loss_mask", "old_log_probs",
                                                   "ref_log_probs")})
        return original(self, batch, *args, **kwargs)

    MegatronEngine.train_batch = spy
    try:
        summary = run_grpo(cfg)
    finally:
        MegatronEngine.train_batch = original
        destroy_distributed()
    g, m, p, v = cfg.grpo.group_size, cfg.grpo.mini_batches, cfg.grpo.prompt_len, cfg.policy.model.vocab_size
    assert len(seen) == cfg.grpo.steps * m

    # --- 1. every mini-batch: whole groups, advantages = float64 GRPO of the reference reward ---
    step_rewards = []
    for i, fields in enumerate(seen):
        ids, mask = fields["input_ids"], fields["loss_mask"]
        assert ids.shape == (cfg.grpo.prompts_per_step * g // m, p + cfg.grpo.response_len)
        prompts = ids[:, :p].view(-1, g, p)
        assert bool((prompts == prompts[:, :1]).all()), "a group's responses must share one prompt"
        rewards = [_reference_reward(row, p, v) for row in ids.tolist()]
        expected = torch.tensor(_reference_advantages(rewards, g, cfg.grpo.adv_epsilon), dtype=torch.float64)
        torch.testing.assert_close(fields["advantages"].double(), expected[:, None] * mask.double(),
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(mask, response_mask(tuple(ids.shape), p))
        if i == 0:   # the frozen reference starts as the policy: same seed, same weights
            on = mask.bool()
            torch.testing.assert_close(fields["ref_log_probs"][on], fields["old_log_probs"][on], rtol=0,
                                       atol=1e-6)
        step_rewards += rewards
    if rank != 0:
        return

    # --- 2. outputs: one record per step with finite, in-range metrics; the curve; the config ---
    run = Path(out_dir) / "e2e"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(cfg.grpo.steps))
    per_step = len(step_rewards) // cfg.grpo.steps
    for r in records:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_std"] >= 0.0
        expected_mean = statistics.fmean(step_rewards[r["step"] * per_step:(r["step"] + 1) * per_step])
        assert math.isclose(r["reward_mean"], expected_mean, rel_tol=1e-6, abs_tol=1e-7)   # float32 rewards
        assert 0.0 <= r["pg_clipfrac"] <= 1.0 and 0.0 < r["entropy"] <= math.log(v) + 1e-5
        assert r["kl"] >= 0.0 and r["kl_loss"] >= 0.0 and math.isfinite(r["grad_norm"])
        assert r["tokens_per_s"] > 0 and r["mem_gib"] > 0 and r["update_skipped"] == 0.0
    assert records[0]["kl"] < 1e-6 and records[-1]["kl"] > 1e-3, [r["kl"] for r in records]
    assert max(r["pg_clipfrac"] for r in records) > 0.0, "the second mini-batch is off-policy: some clip"
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert GRPOJobConfig.from_yaml(run / "config.yaml") == cfg

    # --- 3. it learns: the reward of the last 3 steps clearly above the first 3 (chance 1/7) ---
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.25, rewards
    assert summary.window == 5 and math.isclose(summary.reward_last, statistics.fmean(rewards[-5:]))


@pytest.mark.slow
def test_grpo_job_tp2(tmp_path):
    run_distributed(_grpo_job, 2, str(tmp_path))


# LoRA (configs/grpo_tiny_lora_tp2.yaml: rank 16 on every linear, base init std 0.2) on the same short
# job, lr 1e-2: over 4 seeds the last 3 of 16 steps average 0.51-0.70 against 0.06-0.18 at step 0.
def _grpo_lora_job(rank: int, world_size: int, out_dir: str) -> None:
    import dataclasses

    from mcore_engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.recipes.grpo import ReferencePolicy, run_grpo

    cfg = GRPOJobConfig.from_yaml(GRPO_LORA_CONFIG, [*_E2E, f"output_dir={out_dir}"])
    built: list[MegatronEngine] = []                             # every engine the recipe initialises
    seen: list[dict[str, torch.Tensor]] = []
    start: dict[str, torch.Tensor] = {}                          # the policy's parameters before training
    original_init, original_train = MegatronEngine.initialize, MegatronEngine.train_batch

    def init_spy(self):
        built.append(self)
        return original_init(self)

    def train_spy(self, batch, *args, **kwargs):
        if not start:
            start.update({n: p.detach().clone() for c in self.model for n, p in c.module.named_parameters()})
        seen.append({k: batch[k].clone() for k in ("input_ids", "loss_mask", "old_log_probs",
                                                   "ref_log_probs")})
        return original_train(self, batch, *args, **kwargs)

    MegatronEngine.initialize, MegatronEngine.train_batch = init_spy, train_spy
    try:
        run_grpo(cfg)
    finally:
        MegatronEngine.initialize, MegatronEngine.train_batch = original_init, original_train
    try:
        # --- 1. one engine: the reference is the policy with its adapters disabled ---
        assert len(built) == 1, f"{len(built)} engines built: the LoRA reference must not be a second one"
        policy = built[0]
        params = {n: p for c in policy.model for n, p in c.module.named_parameters()}
        base = {n for n in params if "lora_" not in n}
        adapters = set(params) - base
        assert base and adapters and params.keys() == start.keys()
        # --- 2. the base bit-identical, frozen (no gradient, no grad buffer); only the adapters trained ---
        for n in base:
            assert torch.equal(params[n].detach(), start[n]), f"base weight {n} changed"
            assert not params[n].requires_grad and not hasattr(params[n], "main_grad"), n
        assert all(params[n].requires_grad for n in adapters)
        assert all(not start[n].any() and params[n].detach().any() for n in adapters if "lora_B" in n), \
            "every B starts at zero and is trained"
        assert all(not torch.equal(params[n].detach(), start[n]) for n in adapters if "lora_A" in n)
        # --- 3. the reference log-probs are the base model's: a plain engine from the same seed ---
        plain = MegatronEngine(dataclasses.replace(cfg.policy, forward_only=True,
                                                   model=dataclasses.replace(cfg.policy.model, lora=None)))
        plain.initialize()
        plain_params = {n: p.detach() for c in plain.model for n, p in c.module.named_parameters()}
        assert plain_params.keys() == base and all(torch.equal(plain_params[n], start[n]) for n in base)
        plain_ref = ReferencePolicy(plain, adapters_off=False)
        for fields in (seen[0], seen[-1]):                       # the first and the last update
            on = fields["loss_mask"].bool()
            expected = plain_ref.log_probs(fields["input_ids"], temperature=cfg.grpo.temperature,
                                           micro_batch_size=cfg.grpo.inference_micro_batch_size)
            torch.testing.assert_close(fields["ref_log_probs"][on], expected[on], rtol=0, atol=1e-5)
        # B = 0: the policy starts as the base (the adapted linears' own matmul: fp32 rounding apart)
        first, last = seen[0], seen[-1]
        on = first["loss_mask"].bool()
        torch.testing.assert_close(first["old_log_probs"][on], first["ref_log_probs"][on], rtol=0, atol=1e-5)
        on = last["loss_mask"].bool()
        assert (last["old_log_probs"][on] - last["ref_log_probs"][on]).abs().max() > 0.1
    finally:
        destroy_distributed()
    if rank != 0:
        return

    # --- 4. it learns, and the KL to the base grows from zero ---
    records = read_metrics(Path(out_dir) / "e2e" / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in records]
    assert len(rewards) == cfg.grpo.steps
    chance = 1.0 / cfg.policy.model.vocab_size
    assert statistics.fmean(rewards[-3:]) > max(chance, rewards[0]) + 0.25, rewards
    assert records[0]["kl"] < 1e-6 and records[-1]["kl"] > 1e-2, [r["kl"] for r in records]


@pytest.mark.slow
def test_grpo_lora_job_tp2(tmp_path):
    run_distributed(_grpo_lora_job, 2, str(tmp_path))
