"""verl's LoRA hooks on the mcore_engine backend through a real ``TrainingWorker`` (2 gloo ranks, TP=2
with sequence parallelism), on nonzero adapters (a random PEFT folder loaded through
``model.lora.adapter_path``, B != 0):

- the reference policy from the actor: ``infer_batch`` with verl's ``no_lora_adapter`` flag (what
  ``RayPPOTrainer._compute_ref_log_prob`` sets with ``ref_in_actor``; ``TrainingWorker`` runs the
  engine inside ``engine.disable_adapter()``) gives the base model's log-probs (a separate engine
  without LoRA on the same HF folder), without the flag the LoRA model's; the same after a training
  step (the base is frozen, the adapters moved), and the flag does not leak into the next call;
- the weight sync as ``ActorRolloutRefWorker.update_weights`` calls it, checked by what a rollout does
  with it (``verl_peft.PeftReceiver`` on a ``transformers`` model: PEFT, as vLLM's ``add_lora``):
  ``merge=False`` (verl's default): ``base_sync_done=False`` is the frozen base (bit-identical to the HF
  folder) and ``True`` the adapters in PEFT key names, each with verl's PEFT config (PEFT's enums);
  the receiver's model then gives the actor's log-probs. ``merge=True``: merged weights, no PEFT
  config, the core's ``per_tensor_generator`` exactly, and again the actor's log-probs.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make setup` (pip install --no-deps verl==0.9.1)")
pytest.importorskip("peft")

from tests.integrations.verl_setup import make_hf_model  # noqa: E402
from tests.utils import rel_err, run_distributed  # noqa: E402

RANK, ALPHA, TOL = 4, 8.0, 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"type": "canonical_lora", "merge": False, "rank": RANK, "alpha": ALPHA, "dropout": 0.0,
        "target_modules": ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate",
                           "linear_fc1_up", "linear_fc2"], "lora_A_init_method": "kaiming",
        "lora_B_init_method": "zero"}


def make_adapter(hf_dir: str, out: str) -> None:
    """A PEFT folder with random nonzero adapters (``init_lora_weights=False``: B != 0) on all seven
    projections of the HF model in ``hf_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                           init_lora_weights=False))
    with torch.no_grad():  # adapters that move the log-probs well beyond the tolerance
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    peft.save_pretrained(out)


def hf_log_probs(model, data) -> list[torch.Tensor]:
    """Per sequence of verl's no-padding batch: log p(ids[t + 1] | ids[: t + 1]) for t < len - 1, from a
    ``transformers`` model (fp32)."""
    out = []
    with torch.no_grad():
        for ids in data["input_ids"].unbind():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
            out.append(logp[:-1].gather(-1, ids[1:, None])[:, 0])
    return out


def same_log_probs(got, want, what: str, report: dict) -> None:
    """``got``: verl's jagged log-probs (position t: the token at t + 1; the last position unused);
    ``want``: the same layout (jagged, or per-sequence tensors of length >= len - 1)."""
    rows = got.unbind()
    want = want.unbind() if isinstance(want, torch.Tensor) else want
    a = torch.cat([r[: len(r) - 1] for r in rows])
    b = torch.cat([w[: len(r) - 1] for r, w in zip(rows, want, strict=True)])
    report[what] = max(report.get(what, 0.0), rel_err(a, b))
    assert report[what] < TOL, f"{what}: relative error {report[what]:.2e}"


def lora_ranks(rank: int, world: int, hf_dir: str, adapter_dir: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29998",
                      LOCAL_RANK="0", VERL_ENGINE_DEVICE="cpu")
    import dataclasses
    import json
    from functools import partial

    from peft import PeftType, TaskType
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from verl.trainer.config.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from mcore_engine import MegatronEngine
    from mcore_engine.integrations.verl import McoreEngineVerlConfig
    from tests.integrations.test_verl import actor_config, make_batch, native_batch, ppo_train_batch
    from tests.integrations.verl_peft import PeftReceiver

    report: dict[str, float] = {}
    model = HFModelConfig(path=hf_dir, load_tokenizer=False, enable_gradient_checkpointing=False,
                          lora=dict(LORA, adapter_path=adapter_dir))
    engine = McoreEngineVerlConfig(dtype="float32", tensor_model_parallel_size=2, micro_batch_size_per_gpu=2,
                                   use_dynamic_bsz=False, use_distributed_optimizer=False)
    optim = McoreOptimizerConfig(lr=1e-2, lr_decay_style="constant", weight_decay=0.01, clip_grad=1.0)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                 engine_config=engine, optimizer_config=optim,
                                                 checkpoint_config=CheckpointConfig()))
    worker.device_name, worker.flops_counter = "cpu", None
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config()))
    adapter = worker.engine
    assert adapter.config.model.lora.rank == RANK and adapter.config.parallel.sequence_parallel
    base_cfg = dataclasses.replace(adapter.config, model=dataclasses.replace(adapter.config.model, lora=None),
                                   forward_only=True)
    base = MegatronEngine(base_cfg)  # the base model: what the reference policy must be
    base.initialize()

    def infer(no_adapter: bool):
        data, p_len, r_len = make_batch(10, distill=False)
        tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)
        if no_adapter:
            tu.assign_non_tensor(data, no_lora_adapter=True)
        out = worker.infer_batch(data)
        return data, (None if out is None else tu.get(out, "log_probs")), native_batch(data, p_len, r_len, {})

    def reference_is_base(when: str) -> torch.Tensor | None:
        data, ref, native = infer(no_adapter=True)
        _, policy, _ = infer(no_adapter=False)
        want = base.infer_batch(native)["log_probs"]
        if ref is None:
            return None
        same_log_probs(ref, want, f"{when}: no_lora_adapter == the base model", report)
        distance = rel_err(policy.values(), want.values())
        report[f"{when}: LoRA policy vs base (relative distance)"] = distance
        assert distance > 1e-2, "the adapters must matter"
        return policy

    policy = reference_is_base("initial adapters")
    initial = load_file(os.path.join(hf_dir, "model.safetensors"))
    data, _, _ = infer(no_adapter=False)  # the batch (collective: every rank infers)
    if policy is not None:  # the LoRA policy itself: the HF base + the PEFT folder, with PEFT
        from peft import PeftModel

        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                         adapter_dir).eval()
        same_log_probs(policy, hf_log_probs(peft, data), "initial adapters: policy == PEFT", report)

    # one training step: the adapters move, the base does not; the reference is still the base
    worker.train_batch(ppo_train_batch(0))
    policy = reference_is_base("after a step")

    # the weight sync, merge=False (verl's default): the base once, then the adapters + PEFT config
    adapters, peft_config = adapter.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    base_state, base_peft_config = adapter.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    base_state = dict(base_state)  # consumed first, as verl does (both generators are collective)
    adapters = dict(adapters)
    for config in (peft_config, base_peft_config):
        assert config["peft_type"] is PeftType.LORA and config["task_type"] is TaskType.CAUSAL_LM
        got = (config["r"], config["lora_alpha"], config["lora_dropout"], config["bias"])
        assert got == (RANK, ALPHA, 0.0, "none"), got
        assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert base_state.keys() == initial.keys()
    assert all(torch.equal(base_state[k], initial[k]) for k in initial), "the base sync != the frozen base"
    assert len(adapters) == 2 * 2 * len(TARGETS) and all(
        k.startswith("base_model.model.model.layers.") and k.endswith(("lora_A.weight", "lora_B.weight"))
        for k in adapters), sorted(adapters)
    rollout = PeftReceiver(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    rollout.update("base", base_state, base_peft_config)
    rollout.update("adapter", adapters, peft_config)
    data, _, _ = infer(no_adapter=False)
    if policy is not None:
        same_log_probs(policy, hf_log_probs(rollout.model, data), "adapter sync + PEFT == the actor", report)

    # merge=True: the merged weights, no PEFT config (verl reads the block's flag at sync time)
    adapter.model_config.lora["merge"] = True
    merged, none = adapter.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    merged = dict(merged)
    assert none is None and merged.keys() == initial.keys()
    core = dict(adapter.engine.per_tensor_generator())
    assert all(torch.equal(merged[k], core[k]) for k in core)
    effective = rollout.effective_state()  # the adapter-synced rollout's W + scaling B A
    worst = max(rel_err(merged[k], effective[k]) for k in merged)
    report["merged vs PEFT-applied adapters (worst tensor)"] = worst
    assert worst < TOL, worst
    merged_rollout = PeftReceiver(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    merged_rollout.update("full", merged)
    if policy is not None:
        same_log_probs(policy, hf_log_probs(merged_rollout.model, data), "merged sync == the actor", report)
    adapter.model_config.lora["merge"] = False
    if rank == 0:
        with open(os.path.join(out_dir, "lora.json"), "w") as f:
            json.dump(report, f, indent=1)


@pytest.mark.slow
def test_verl_lora_reference_and_weight_sync(tmp_path):
    hf_dir, adapter_dir = str(tmp_path / "hf"), str(tmp_path / "adapter")
    make_hf_model(hf_dir)
    make_adapter(hf_dir, adapter_dir)
    run_distributed(lora_ranks, 2, hf_dir, adapter_dir, str(tmp_path))
    print(open(tmp_path / "lora.json").read())
