"""Assets and command line of the verl trainer test (``test_verl_trainer.py``): a tiny random Qwen2
student and teacher (and a Qwen3-MoE, a Qwen3.5 and a gpt-oss student) with a character-level tokenizer, a
parquet prompt set, and the ``python -m verl.trainer.main_ppo`` command line: the packaged config that
puts actor, reference (and critic) on the ``mcore_engine`` backend (the one a user passes, README "Use
it from verl"), the overrides of a tiny fp32 CPU run, and the rollout / teacher on the harness's
``hf_cpu`` servers."""

from __future__ import annotations

import os
import string
import sys

import torch

from tests.integrations.verl_setup import VOCAB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = "tests.integrations.verl_trainer_harness"
# the backend's verl config (mcore_engine/integrations/verl_hydra), exactly as the README shows it
CONFIG = ["--config-path", "pkg://mcore_engine.integrations.verl_hydra",
          "--config-name", "ppo_mcore_engine_trainer"]
REWARD_FILE = os.path.join(ROOT, "tests", "integrations", "verl_trainer_reward.py")
SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")


def make_tokenizer(path: str):
    """A character-level ``PreTrainedTokenizerFast`` with exactly VOCAB ids (specials, printable ASCII and
    newline, filler tokens ``<xN>`` that decode as text), built locally, saved into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # newline: verl's Qwen chat builder
    tokens = SPECIALS + chars
    tokens += [f"<x{i}>" for i in range(VOCAB - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_model(path: str, seed: int) -> None:
    """A tiny random Qwen2 causal LM (the shape of ``verl_setup.make_hf_model``)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)


def make_moe_model(path: str, seed: int) -> None:
    """A tiny random Qwen3-MoE causal LM: 2 MoE layers of 4 experts (width 32), top-2, renormalised
    weights; the routers drawn with std 0.2 (HF's 0.02 leaves near-ties between experts)."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)


def make_qwen3_5_model(path: str, seed: int) -> None:
    """A tiny random Qwen3.5 causal LM (``Qwen3_5ForCausalLM``, model type ``qwen3_5_text``): 4 layers,
    three Gated DeltaNet (2 key / 4 value heads of 16, conv kernel 4) then one gated full attention
    (4 query / 2 key-value heads of 16, partial rotary 0.25), hidden 64, untied lm-head. Decays as
    a trained model's, not the init's (``A_log = log(uniform(0.05, 1))``), the zero-centred norms
    (and the GDN's gated norm) off their init by ``N(0, 0.1)``, the pad token's embedding not zero."""
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                            layer_types=["linear_attention"] * 3 + ["full_attention"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            partial_rotary_factor=0.25,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=128,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        # transformers zeroes the pad token's embedding row (padding_idx) at init and never trains it;
        # the rollout samples that token (~1 in 250) and Megatron's embedding, which has no
        # padding_idx, then back-propagates through the input RMSNorm of a zero vector (x 1/sqrt(eps)):
        # a grad norm of ~550 that the clip turns into a lost step. Trained rows are not zero.
        model.model.embed_tokens.weight[cfg.pad_token_id].normal_(0.0, cfg.initializer_range)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)


def make_gpt_oss_model(path: str, seed: int) -> None:
    """A tiny random gpt-oss causal LM (``GptOssForCausalLM``): 2 layers, the first with a 4-token
    sliding window (prompts and responses are longer), YaRN RoPE, 4 query / 2 key-value heads of 16,
    hidden 64, 4 experts (width 32), top-2, untied lm-head, fp32. The attention sinks ``N(0, 1)`` and
    every bias (q / k / v / o, router, experts) ``N(0, 0.1)`` (the init leaves the biases at 0 and
    the sinks ~0.02), the routers drawn with std 0.2 (no near-ties), the pad token's embedding not
    zero (see :func:`make_qwen3_5_model`)."""
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=yarn,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("bias", "_bias")):
                p.normal_(0.0, 0.1)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.2)
        model.model.embed_tokens.weight[cfg.pad_token_id].normal_(0.0, cfg.initializer_range)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)


def tokenizer_dir(work: str) -> str:
    """The tokenizer's own folder (``model.tokenizer_path``): beside a ``config.json`` saying qwen2,
    transformers 5's ``AutoTokenizer`` would load it as a ``Qwen2Tokenizer`` with Qwen's byte-level
    pre-tokenizer instead of this character-level one."""
    return os.path.join(work, "tokenizer")


def make_dataset(path: str, n: int = 16, seed: int = 0) -> None:
    """verl's RL parquet layout: chat ``prompt``, ``data_source``, ``reward_model.ground_truth``."""
    import pandas as pd

    g = torch.Generator().manual_seed(seed)
    letters = string.ascii_lowercase
    rows = []
    for i in range(n):
        target = letters[int(torch.randint(0, 26, (1,), generator=g))]
        word = "".join(letters[int(j)] for j in torch.randint(0, 26, (3,), generator=g))
        rows.append({"data_source": "char_class", "prompt": [{"role": "user", "content": f"{word} {target}"}],
                     "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "lowercase"},
                     "extra_info": {"index": i}})
    pd.DataFrame(rows).to_parquet(path)


def trainer_command(work: str, model_dir: str, data_file: str, *, steps: int, teacher_dir: str | None = None,
                    critic: bool = False, tp: int = 1, cp: int = 1, extra: tuple[str, ...] = (),
                    prompt_length: int = 16, tokenizer_path: str | None = None) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the backend's config (:data:`CONFIG`: verl's
    ``ppo_megatron_trainer`` with every role on mcore_engine, no per-role strategy overrides) and the
    overrides of a tiny CPU run: fp32 (the actor's dtype, which reference and critic follow), GRPO
    (n=4) with a KL loss (so a reference policy), 4 prompts a step, responses of at most 12 tokens;
    ``teacher_dir``: verl's on-policy distillation with that teacher (top-k forward KL); ``critic``:
    verl's critic (``critic.enable``) too; ``tp`` x ``cp`` ranks, actor / reference / critic at TP
    ``tp`` and CP ``cp``, one rollout replica over all of them; ``extra``: more overrides (e.g. LoRA's);
    ``prompt_length``: data's and rollout's; ``tokenizer_path``: default :func:`tokenizer_dir`."""
    arr = "actor_rollout_ref"
    tokenizer_path = tokenizer_path or tokenizer_dir(work)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *CONFIG,
           "trainer.use_v1=False", "trainer.device=cpu", f"trainer.n_gpus_per_node={tp * cp}",
           "trainer.nnodes=1",
           f"trainer.total_training_steps={steps}", "trainer.total_epochs=10",
           "trainer.logger=[console,file]",
           "trainer.val_before_train=False", "trainer.test_freq=-1", f"trainer.save_freq={steps}",
           f"trainer.default_local_dir={work}/checkpoints", "trainer.project_name=mcore_engine",
           "trainer.experiment_name=cpu", "trainer.balance_batch=False",
           "+ray_kwargs.ray_init.num_cpus=32", "+ray_kwargs.ray_init.num_gpus=4",
           "+ray_kwargs.ray_init.include_dashboard=False",
           f"data.train_files={data_file}", f"data.val_files={data_file}", "data.train_batch_size=4",
           f"data.max_prompt_length={prompt_length}", "data.max_response_length=12",
           "data.dataloader_num_workers=0", "data.shuffle=False",
           f"{arr}.model.path={model_dir}", f"{arr}.model.tokenizer_path={tokenizer_path}",
           f"{arr}.model.use_remove_padding=True",
           f"{arr}.actor.ppo_mini_batch_size=4", f"{arr}.actor.ppo_micro_batch_size_per_gpu=8",
           f"{arr}.actor.use_dynamic_bsz=False", f"{arr}.actor.optim.lr=1e-2",
           f"{arr}.actor.optim.lr_warmup_steps_ratio=0", f"{arr}.actor.use_kl_loss=True",
           f"{arr}.actor.kl_loss_coef=0.01", f"{arr}.actor.entropy_coeff=0",
           f"{arr}.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
           f"{arr}.actor.megatron.dtype=float32", f"{arr}.actor.megatron.use_distributed_optimizer=False",
           f"{arr}.actor.megatron.tensor_model_parallel_size={tp}",
           f"{arr}.actor.megatron.context_parallel_size={cp}",
           f"{arr}.ref.log_prob_micro_batch_size_per_gpu=8",
           f"{arr}.rollout.name=hf_cpu", f"{arr}.rollout.mode=async", f"{arr}.rollout.n=4",
           f"{arr}.rollout.temperature=1.0", f"{arr}.rollout.top_p=1.0", f"{arr}.rollout.top_k=-1",
           f"{arr}.rollout.calculate_log_probs=True", f"{arr}.rollout.tensor_model_parallel_size={tp * cp}",
           f"{arr}.rollout.log_prob_micro_batch_size_per_gpu=8", f"{arr}.rollout.agent.num_workers=1",
           f"{arr}.rollout.prompt_length={prompt_length}", f"{arr}.rollout.response_length=12",
           f"{arr}.rollout.checkpoint_engine.backend=naive", f"{arr}.rollout.free_cache_engine=True",
           "reward.num_workers=1", f"reward.custom_reward_function.path={REWARD_FILE}",
           "reward.custom_reward_function.name=compute_score",
           "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False"]
    if critic:
        cmd += ["critic.enable=True", f"critic.model.path={model_dir}",
                f"critic.model.tokenizer_path={tokenizer_path}",
                "critic.ppo_micro_batch_size_per_gpu=8",
                "critic.optim.lr=1e-2", "critic.optim.lr_warmup_steps_ratio=0",
                "critic.megatron.use_distributed_optimizer=False",
                f"critic.megatron.tensor_model_parallel_size={tp}",
                f"critic.megatron.context_parallel_size={cp}"]
    if teacher_dir is not None:
        teacher = "distillation.teacher_models.teacher_model"
        cmd += ["distillation.enabled=True", "distillation.n_gpus_per_node=1", "distillation.nnodes=1",
                "distillation.distillation_loss.loss_mode=forward_kl_topk",
                "distillation.distillation_loss.topk=4",
                "distillation.distillation_loss.use_task_rewards=False",
                f"{teacher}.model_path={teacher_dir}",
                f"{teacher}.num_replicas=1", f"{teacher}.inference.tensor_model_parallel_size=1",
                f"{teacher}.inference.name=hf_cpu"]
    return cmd + list(extra)


def trainer_env(work: str) -> dict[str, str]:
    """The environment of the trainer process (inherited by Ray's workers)."""
    report = os.path.join(work, "report")
    os.makedirs(report, exist_ok=True)
    env = dict(os.environ)
    env.update(VERL_USE_EXTERNAL_MODULES=HARNESS, VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               VERL_FILE_LOGGER_PATH=os.path.join(work, "metrics.jsonl"), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0", HYDRA_FULL_ERROR="1",
               WANDB_MODE="disabled", VERL_HARNESS_REPORT_DIR=report)
    return env
