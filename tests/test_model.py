"""GPTModel from config: Megatron's padded-vocab rule, TP=2 vs TP=1 on identical weights (values and
gradients, fp32 and bf16, several architecture options), packed ``thd`` vs padded ``bshd``, activation
recompute vs none, and the fused lm-head surgery (hidden states + the lm-head weight) vs the logits."""

from __future__ import annotations

import pytest
import torch

from tests.utils import REL_TOL, assert_rel_close, run_distributed


@pytest.mark.parametrize("vocab,div,tp,expected", [(250, 128, 1, 256), (250, 128, 2, 256), (257, 128, 2, 512),
                                                    (256, 128, 2, 256), (151936, 128, 2, 152064),
                                                    (151936, 128, 4, 152064), (50257, 128, 8, 51200),
                                                    (7, 1, 3, 9)])
def test_padded_vocab_size(vocab, div, tp, expected):
    from mcore_engine.model.build import padded_vocab_size

    assert padded_vocab_size(vocab, div, tp) == expected


@pytest.mark.parametrize("bad", [dict(vocab_size=0), dict(divisible_by=-1), dict(tp=1.5)])
def test_padded_vocab_size_rejects(bad):
    from mcore_engine.model.build import padded_vocab_size

    args = dict(vocab_size=250, divisible_by=128, tp=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        padded_vocab_size(**args)


def test_build_model_chunks_needs_parallel_state():
    from megatron.core import parallel_state

    from mcore_engine.config import EngineConfig
    from mcore_engine.model.build import build_model_chunks

    if parallel_state.model_parallel_is_initialized():
        pytest.skip("parallel_state initialised by another test in this process")
    with pytest.raises(ValueError, match="init_distributed"):
        build_model_chunks(EngineConfig.from_yaml("configs/tiny_cpu_tp2.yaml"))


def test_transformer_config_from_engine_config():
    from mcore_engine.config import EngineConfig, ParallelConfig
    from mcore_engine.model.transformer_config import build_transformer_config

    cfg = EngineConfig.from_yaml("configs/qwen2_0p5b_tp2.yaml")
    tc = build_transformer_config(cfg)
    sizes = (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups, tc.ffn_hidden_size)
    assert sizes == (24, 896, 14, 2, 4864)
    assert tc.params_dtype == torch.bfloat16 and tc.bf16 and tc.gated_linear_unit and tc.add_qkv_bias
    assert not tc.add_bias_linear and tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-6
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.tensor_model_parallel_size == 2 and tc.use_cpu_initialization == (not torch.cuda.is_available())
    cfg.parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert build_transformer_config(cfg).sequence_parallel


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_norm_marks_sequence_parallel_params(normalization, sequence_parallel):
    """mcore_engine.layers.norm: the local spec's norms are torch's, their parameters marked for the TP sum
    of sequence parallelism; every WrappedTorchNorm of Megatron's local spec is replaced."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mcore_engine.layers.norm import TorchNorm, ZeroCenteredRMSNorm, with_torch_norms

    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization,
                           sequence_parallel=sequence_parallel, tensor_model_parallel_size=2)
    norm = TorchNorm(tc, 8, eps=1e-6)
    assert type(norm) is getattr(torch.nn, normalization)
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
    spec = with_torch_norms(get_gpt_layer_local_spec(qk_layernorm=True, normalization=normalization))
    subs = spec.submodules
    for found in (subs.input_layernorm, subs.pre_mlp_layernorm, subs.self_attention.submodules.q_layernorm):
        assert found is TorchNorm and found is not WrappedTorchNorm
    tc.layernorm_zero_centered_gamma = True  # Qwen3.5's RMSNorm (1 + w); no zero-centred LayerNorm
    if normalization == "RMSNorm":
        norm = TorchNorm(tc, 8)
        assert type(norm) is ZeroCenteredRMSNorm
        assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
    else:
        with pytest.raises(ValueError, match="zero-centred LayerNorm"):
            TorchNorm(tc, 8)


# ----------------------------------------------------------------------------------------------------
# 2-rank launch
# ----------------------------------------------------------------------------------------------------
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
            vocab_size=250, max_sequence_length=64, add_qkv_bias=True)
VARIANTS = {
    "rmsnorm_swiglu_gqa_qkvbias": ({}, "fp32"),
    "layernorm_gelu_mha_tied_qknorm": (dict(normalization="LayerNorm", swiglu=False, num_query_groups=None,
                                            tie_word_embeddings=True, qk_layernorm=True, add_qkv_bias=False),
                                       "fp32"),
    "bf16": ({}, "bf16"),
}


def _shard(full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's TP shard of a full tensor, by Megatron's partition attributes (dim, stride)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    pieces = torch.split(full, full.shape[dim] // (stride * world), dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def _build(model_kwargs: dict, precision: str, tp: int):
    from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.distributed import init_distributed

    cfg = EngineConfig(model=ModelConfig(**(BASE | model_kwargs)),
                       parallel=ParallelConfig(tensor_model_parallel_size=tp), precision=precision)
    init_distributed(cfg.parallel, cfg.seed)
    chunks = build_model_chunks(cfg)
    assert len(chunks) == 1
    return chunks[0]


def _run(model, ids, pos, w, mask=None, packed=None):
    model.zero_grad()
    logits = model(ids, pos, mask, packed_seq_params=packed)
    (logits.float() * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def _compare_tp(rank: int, world: int, name: str, model_kwargs: dict, precision: str) -> None:
    from mcore_engine.parallel.distributed import destroy_distributed

    # fp32: TP shards are exact slices, so only the reduction order differs (up to 1.2e-6 measured)
    tol = REL_TOL[torch.bfloat16] if precision == "bf16" else 1e-5
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 250, (3, 19), generator=g)
    pos = torch.arange(19).expand(3, 19)
    w_full = torch.randn(3, 19, 256, generator=g)

    ref = _build(model_kwargs, precision, tp=1)
    assert ref.share_embeddings_and_output_weights == bool(model_kwargs.get("tie_word_embeddings"))
    ref_params = dict(ref.named_parameters())
    ref_logits, ref_grads = _run(ref, ids, pos, w_full)
    assert ref_logits.shape == (3, 19, 256)
    destroy_distributed()

    model = _build(model_kwargs, precision, tp=2)
    v_local = 256 // world
    vocab_slice = slice(rank * v_local, (rank + 1) * v_local)
    logits, grads = _run(model, ids, pos, w_full[..., vocab_slice])
    assert logits.shape == (3, 19, v_local) and logits.dtype == ref_logits.dtype
    assert_rel_close(logits.float(), ref_logits[..., vocab_slice].float(), tol, f"{name}: logits")
    for pname, p in model.named_parameters():
        if "q_layernorm" in pname or "k_layernorm" in pname:
            # per-head norms see only this rank's heads: partial grads that Megatron's
            # finalize_model_grads sums over the TP group
            from megatron.core import parallel_state

            torch.distributed.all_reduce(grads[pname], group=parallel_state.get_tensor_model_parallel_group())
        assert torch.equal(p.detach(), _shard(ref_params[pname].detach(), p, rank, world)), \
            f"{name}: {pname} is not the TP slice of the TP=1 weight"
        assert_rel_close(grads[pname].float(), _shard(ref_grads[pname], p, rank, world).float(), tol,
                         f"{name}: grad {pname}")
    destroy_distributed()


def _compare_thd_bshd(rank: int, world: int) -> None:
    """Packed thd (PackedDotProductAttention) equals padded bshd per real token, values and grads."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_engine.parallel.distributed import destroy_distributed

    lengths = [7, 12, 1]
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 250, (n,), generator=g) for n in lengths]
    v_local = 256 // world
    w_seqs = [torch.randn(n, 256, generator=g)[:, rank * v_local:(rank + 1) * v_local] for n in lengths]
    model = _build({}, "fp32", tp=2)

    s = max(lengths)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    w = torch.zeros(len(seqs), s, v_local)
    for i, (q, ws) in enumerate(zip(seqs, w_seqs, strict=True)):
        ids[i, :len(q)] = q
        w[i, :len(q)] = ws
    pos = torch.arange(s).expand(len(seqs), s)
    ref_logits, ref_grads = _run(model, ids, pos, w)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s,
                             max_seqlen_kv=s)
    thd_ids = torch.cat(seqs)[None]
    thd_pos = torch.cat([torch.arange(n) for n in lengths])[None]
    logits, grads = _run(model, thd_ids, thd_pos, torch.cat(w_seqs)[None], packed=packed)
    expected = torch.cat([ref_logits[i, :n] for i, n in enumerate(lengths)])[None]
    assert_rel_close(logits, expected, REL_TOL[torch.float32], "thd logits")
    for pname, gr in grads.items():
        assert_rel_close(gr, ref_grads[pname], REL_TOL[torch.float32], f"thd grad {pname}")
    destroy_distributed()


RECOMPUTE = {"full": dict(recompute_granularity="full"),  # uniform, 1 layer per unit
             "full_block": dict(recompute_granularity="full", recompute_method="block",
                                recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])}


def _compare_recompute(rank: int, world: int) -> None:
    """Activation recompute (packed thd, TP=2, fp32) gives bit-identical logits and gradients; full
    recompute reruns every layer's forward in the backward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.distributed import destroy_distributed, init_distributed

    lengths = [7, 12, 1]
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 250, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    w = torch.randn(1, sum(lengths), 256, generator=g)[..., rank * 256 // world:(rank + 1) * 256 // world]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12,
                             max_seqlen_kv=12)
    results = {}
    for name, recompute in {"none": {}, **RECOMPUTE}.items():
        parallel = ParallelConfig(tensor_model_parallel_size=world)
        cfg = EngineConfig(model=ModelConfig(**BASE), parallel=parallel, **recompute)
        init_distributed(cfg.parallel, cfg.seed)
        (model,) = build_model_chunks(cfg)
        calls: list[int] = []
        model.decoder.layers[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        results[name] = _run(model, ids, pos, w, packed=packed)
        assert len(calls) == (2 if name.startswith("full") else 1), f"{name}: {len(calls)} layer-0 forwards"
        destroy_distributed()
    ref_logits, ref_grads = results.pop("none")
    for name, (logits, grads) in results.items():
        assert torch.equal(logits, ref_logits), f"recompute {name}: logits differ"
        for pname, grad in grads.items():
            assert torch.equal(grad, ref_grads[pname]), f"recompute {name}: grad {pname} differs"


def _model_checks(rank: int, world: int) -> None:
    for name, (kwargs, precision) in VARIANTS.items():
        _compare_tp(rank, world, name, kwargs, precision)
    _compare_thd_bshd(rank, world)
    _compare_recompute(rank, world)


@pytest.mark.slow
def test_tp2_matches_tp1_and_thd_matches_bshd():
    run_distributed(_model_checks, 2)


LM_KEYS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")


# ----------------------------------------------------------------------------------------------------
# output_hidden_states + lm_head_weight + the fused lm-head (TP=2) == the logits path
# ----------------------------------------------------------------------------------------------------
def _gpt_run(model, fused: bool, ids, pos, kwargs: dict, upstream: dict):
    """Outputs and parameter grads of the logits path (``fused=False``) or the fused lm-head path."""
    from mcore_engine.model.head import lm_head_weight, output_hidden_states
    from mcore_engine.ops import vocab_parallel_logits_outputs
    from mcore_engine.ops.lm_head import fused_lm_head_outputs

    model.zero_grad(set_to_none=True)
    output_hidden_states(model, enable=fused)
    y = model(ids, pos, None)
    out = (fused_lm_head_outputs(y, lm_head_weight(model), **kwargs) if fused
           else vocab_parallel_logits_outputs(y, **kwargs))
    sum((out[k].double() * upstream[k].double()).sum() for k in LM_KEYS).backward()
    return y, out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_checks(rank: int, world: int) -> None:
    from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.distributed import destroy_distributed, init_distributed

    g = torch.Generator().manual_seed(21)
    b, s, vocab, k = 2, 11, 250, 3
    ids = torch.randint(0, vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    kwargs = dict(labels=torch.randint(0, vocab, (b, s), generator=g),
                  teacher_ids=torch.rand(b, s, vocab, generator=g).argsort(-1)[..., :k],
                  teacher_log_probs=torch.randn(b, s, k, generator=g).log_softmax(-1) - 0.2, entropy=True,
                  sum_pi_squared=True, kl_tail=True, temperature=0.8, vocab_size=vocab)
    upstream = {key: torch.randn(b, s, generator=g) for key in LM_KEYS}
    for tied in (False, True):
        arch = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                           vocab_size=vocab, max_sequence_length=32, tie_word_embeddings=tied)
        cfg = EngineConfig(model=arch, parallel=ParallelConfig(tensor_model_parallel_size=world))
        init_distributed(cfg.parallel, cfg.seed)
        (model,) = build_model_chunks(cfg)
        logits, ref, ref_grads = _gpt_run(model, False, ids, pos, kwargs, upstream)
        hidden, out, grads = _gpt_run(model, True, ids, pos, kwargs, upstream)
        assert hidden.shape == (b, s, 32) and logits.shape == (b, s, 256 // world)
        for key in ref:
            assert_rel_close(out[key], ref[key], REL_TOL[torch.float32], f"tied={tied} {key}")
        for name, grad in grads.items():
            assert_rel_close(grad, ref_grads[name], REL_TOL[torch.float32], f"tied={tied} grad {name}")
        assert _gpt_run(model, False, ids, pos, kwargs, upstream)[0].shape == logits.shape  # restored
        destroy_distributed()


@pytest.mark.slow
def test_gpt_model_fused_lm_head_matches_logits_path_tp2():
    run_distributed(_gpt_checks, 2)
