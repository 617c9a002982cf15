"""mcore_engine.layers.mrope: MultimodalRotaryEmbedding's freqs through Megatron-Core's
apply_rotary_pos_emb against ``transformers``' mRoPE (rotary module + apply_rotary_pos_emb of Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): values and q / k gradients in float64, fp32 and bf16,
sectioned, interleaved and partial rotary, positions from rope_index on random image / video samples and
arbitrary 3-D positions, and a real layout at the released head dims; a thd pack equals its sequences
alone; on two gloo ranks CP = 2 (bshd cut, thd whole pack cut by Megatron, and GPTModel's own ``mrope``
call) equals CP = 1 at this rank's slots, text-only positions equal Megatron's RotaryEmbedding at CP = 1
and 2; bad inputs."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from mcore_engine.config.vision import VisionConfig
from mcore_engine.data.rope_index import rope_index
from mcore_engine.layers.mrope import MultimodalRotaryEmbedding, mrope_axis
from tests.utils import REL_TOL, assert_rel_close, rel_err, run_distributed

IMAGE, VIDEO, START, END = 60, 61, 62, 63
HEADS = 3
# model type -> (head dim, rotary fraction, mrope_section, rope theta); Qwen3.5: partial rotary
SHAPES = {"qwen2_5_vl": (16, 1.0, [2, 3, 3], 10000.0), "qwen3_vl": (24, 1.0, [4, 4, 4], 5e5),
          "qwen3_vl_moe": (16, 1.0, [4, 2, 2], 5e5), "qwen3_5": (64, 0.25, [3, 3, 2], 1e7),
          "qwen3_5_moe": (16, 0.25, [1, 1, 0], 1e4)}


class _OneRank:
    """A context-parallel group of one rank (apply_rotary_pos_emb reads only size() and rank())."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


# ----------------------------------------------------------------------------------------------------
# References and inputs
# ----------------------------------------------------------------------------------------------------
def _hf(model_type: str, shape: tuple | None = None):
    """``transformers``' text rotary module of ``model_type`` (tiny config) and its apply function."""
    import transformers as T
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m25
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35moe
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m3
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m3moe

    d, fraction, section, theta = shape or SHAPES[model_type]
    base = dict(hidden_size=HEADS * d, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=d,
                vocab_size=64, num_hidden_layers=1, intermediate_size=8)
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    if model_type.startswith("qwen3_5"):
        rope["partial_rotary_factor"] = fraction
    else:
        rope["mrope_interleaved"] = model_type != "qwen2_5_vl"
    cfg_cls, rot_cls, module = {
        "qwen2_5_vl": (T.Qwen2_5_VLTextConfig, m25.Qwen2_5_VLRotaryEmbedding, m25),
        "qwen3_vl": (T.Qwen3VLTextConfig, m3.Qwen3VLTextRotaryEmbedding, m3),
        "qwen3_vl_moe": (T.Qwen3VLMoeTextConfig, m3moe.Qwen3VLMoeTextRotaryEmbedding, m3moe),
        "qwen3_5": (T.Qwen3_5TextConfig, m35.Qwen3_5TextRotaryEmbedding, m35),
        "qwen3_5_moe": (T.Qwen3_5MoeTextConfig, m35moe.Qwen3_5MoeTextRotaryEmbedding, m35moe),
    }[model_type]
    rotary = rot_cls(cfg_cls(**base, rope_parameters=rope))
    assert rotary.inv_freq.numel() * 2 == int(d * fraction) and rotary.mrope_section == section
    return rotary, module.apply_rotary_pos_emb


def _ours(model_type: str, shape: tuple | None = None, **kwargs) -> MultimodalRotaryEmbedding:
    d, fraction, section, theta = shape or SHAPES[model_type]
    return MultimodalRotaryEmbedding(d, fraction, theta, section, model_type != "qwen2_5_vl", **kwargs)


def _megatron_config(model_type: str, shape: tuple | None = None):
    from megatron.core.transformer import TransformerConfig

    d, _, section, _ = shape or SHAPES[model_type]
    return TransformerConfig(num_layers=1, hidden_size=HEADS * d, num_attention_heads=HEADS, kv_channels=d,
                             use_cpu_initialization=True, mrope_section=section)


def _vision(model_type: str) -> VisionConfig:
    return VisionConfig(model_type=model_type, vision_config={"spatial_merge_size": 2},
                        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                        mrope_section=SHAPES[model_type][2], mrope_interleaved=model_type != "qwen2_5_vl",
                        tokens_per_second=2)


def _sample_positions(rng: random.Random, model_type: str, length: int | None = None) -> torch.Tensor:
    """rope_index of a random sample: text, 0-2 images of several grids, maybe a video, text; padded
    with text tokens to ``length`` when given (drawn again until it fits). ``[3, L]``."""
    while True:
        ids, images, videos, seconds = _sample_tokens(rng, model_type)
        if length is None or len(ids) <= length:
            break
    if length is not None:
        ids += [rng.randrange(60) for _ in range(length - len(ids))]
    grid = lambda rows: torch.tensor(rows) if rows else None  # noqa: E731
    return rope_index(torch.tensor(ids), _vision(model_type), grid(images), grid(videos), seconds)


def _sample_tokens(rng: random.Random, model_type: str):
    ids, images, videos = [rng.randrange(60) for _ in range(rng.randint(1, 4))], [], []
    for _ in range(rng.choice([0, 1, 2, 2])):
        g = rng.choice([(1, 4, 4), (1, 6, 8), (1, 2, 10), (1, 8, 2)])
        images.append(g)
        ids += [START] + [IMAGE] * (g[1] * g[2] // 4) + [END] + [rng.randrange(60)]
    seconds = None
    if rng.random() < 0.5:
        g = (rng.randint(2, 3), 4, 6)
        videos.append(g)
        if model_type == "qwen2_5_vl":
            ids += [START] + [VIDEO] * (g[0] * 6) + [END]
            seconds = torch.tensor([rng.uniform(0.5, 4.0)])
        else:
            for _ in range(g[0]):
                ids += [rng.randrange(60), START] + [VIDEO] * 6 + [END]
    ids += [rng.randrange(60) for _ in range(rng.randint(0, 3))]
    return ids, images, videos, seconds


def _batch_positions(model_type: str, seed: int, b: int = 2, s: int = 96) -> list[torch.Tensor]:
    """Two kinds of ``[3, b, s]`` positions: rope_index samples, and arbitrary 3-D positions (each axis
    independent, large, so every pair's axis matters)."""
    rng = random.Random(seed)
    samples = torch.stack([_sample_positions(rng, model_type, s) for _ in range(b)], dim=1)
    g = torch.Generator().manual_seed(seed)
    arbitrary = torch.randint(0, 5000, (3, b, s), generator=g)
    return [samples, arbitrary]


def _qkg(b: int, s: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, HEADS, d, generator=g, dtype=torch.float64) for _ in range(4)]


def _run_hf(model_type: str, pos, q, k, gq, gk, dtype, shape: tuple | None = None):
    """transformers' rotated q, k ``[b, s, h, d]`` and their gradients, in ``dtype``."""
    rotary, apply = _hf(model_type, shape)
    q, k = (x.detach().to(dtype).requires_grad_() for x in (q, k))
    cos, sin = rotary(q, pos)
    oq, ok = apply(q, k, cos, sin, unsqueeze_dim=2)
    ((oq * gq.to(dtype)).sum() + (ok * gk.to(dtype)).sum()).backward()
    return [x.detach() for x in (oq, ok, q.grad, k.grad)]


def _run_ours(model_type: str, pos, q, k, gq, gk, dtype, shape: tuple | None = None):
    """Our freqs through Megatron's apply_rotary_pos_emb (bshd), in transformers' ``[b, s, h, d]``."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    module = _ours(model_type, shape)
    config = _megatron_config(model_type, shape)
    freqs = module(pos, (shape or SHAPES[model_type])[2], cp_group=None)
    assert freqs.dtype == torch.float32 and freqs.shape == (pos.size(2), pos.size(1), 1, module.rot_dim)
    q, k = (x.detach().to(dtype).requires_grad_() for x in (q, k))
    oq, ok = (apply_rotary_pos_emb(x.transpose(0, 1), freqs, config, cp_group=_OneRank()).transpose(0, 1)
              for x in (q, k))
    ((oq * gq.to(dtype)).sum() + (ok * gk.to(dtype)).sum()).backward()
    return [x.detach() for x in (oq, ok, q.grad, k.grad)]


NAMES = ("q_out", "k_out", "dq", "dk")


# ----------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------
def _compare(model_type: str, pos: torch.Tensor, seed: int, what: str, shape: tuple | None = None) -> None:
    """float64 and fp32: equal to transformers in float64 (fp32 within its rounding); bf16: within the
    error transformers' own bf16 makes against its float64. Values and q / k gradients."""
    b, s = pos.shape[1:]
    q, k, gq, gk = _qkg(b, s, (shape or SHAPES[model_type])[0], seed=seed)
    snapshot = pos.clone()
    ref = _run_hf(model_type, pos, q, k, gq, gk, torch.float64, shape)
    got = _run_ours(model_type, pos, q, k, gq, gk, torch.float64, shape)
    assert torch.equal(pos, snapshot), "position_ids were modified"
    for name, a, e in zip(NAMES, got, ref, strict=True):
        assert_rel_close(a, e, REL_TOL[torch.float64], f"{what} float64 {name}")
    hf32 = _run_hf(model_type, pos, q, k, gq, gk, torch.float32, shape)
    ours32 = _run_ours(model_type, pos, q, k, gq, gk, torch.float32, shape)
    for name, a, e, h in zip(NAMES, ours32, ref, hf32, strict=True):
        assert_rel_close(a, e, 1e-6, f"{what} fp32 {name} vs float64")
        assert_rel_close(a, h, 1e-6, f"{what} fp32 {name} vs transformers fp32")
    hf16 = _run_hf(model_type, pos, q, k, gq, gk, torch.bfloat16, shape)
    ours16 = _run_ours(model_type, pos, q, k, gq, gk, torch.bfloat16, shape)
    for name, a, e, h in zip(NAMES, ours16, ref, hf16, strict=True):
        err, hf_err = rel_err(a, e), rel_err(h, e)
        assert a.dtype == torch.bfloat16 and err <= 1.25 * hf_err + 1e-3, \
            f"{what} bf16 {name}: {err:.3e} vs transformers' bf16 {hf_err:.3e}"


@pytest.mark.parametrize("model_type", list(SHAPES))
def test_matches_transformers(model_type):
    """Tiny heads; positions of random rope_index samples and arbitrary 3-D positions."""
    for i, pos in enumerate(_batch_positions(model_type, seed=len(model_type))):
        _compare(model_type, pos, i, f"{model_type} (positions {i})")


# The released checkpoints' attention: head dim, rotary fraction, mrope_section, rope theta
REAL = {"qwen2_5_vl": (128, 1.0, [16, 24, 24], 1e6), "qwen3_vl": (128, 1.0, [24, 20, 20], 5e6),
        "qwen3_5": (256, 0.25, [11, 11, 10], 1e7)}


def _real_positions(model_type: str) -> torch.Tensor:
    """rope_index of a chat-like sample with two photos at the processor's real grids (``smart_resize``
    of 480x640 and 200x300 pixels; patch 14 for Qwen2.5-VL, 16 otherwise) and a 4-frame 2 fps video:
    ``[3, 1, L]``, L about 600 (positions up to about 120: a vision run advances by max(h, w))."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision

    patch = 14 if model_type == "qwen2_5_vl" else 16
    rng = random.Random(0)
    text = lambda n: [rng.randrange(60) for _ in range(n)]  # noqa: E731
    images = [[1, *(x // patch for x in smart_resize(h, w, factor=2 * patch))]
              for h, w in ((480, 640), (200, 300))]
    video = [2, *(x // patch for x in smart_resize(240, 320, factor=2 * patch))]
    ids = text(20)
    for g in images:
        ids += [START] + [IMAGE] * (g[0] * g[1] * g[2] // 4) + [END] + text(7)
    frame = video[1] * video[2] // 4
    if model_type == "qwen2_5_vl":
        ids += [START] + [VIDEO] * (video[0] * frame) + [END]
    else:
        for _ in range(video[0]):
            ids += text(4) + [START] + [VIDEO] * frame + [END]
    ids += text(30)
    vision = dataclasses.replace(_vision(model_type), mrope_section=REAL[model_type][2])
    pos = rope_index(torch.tensor(ids), vision, torch.tensor(images), torch.tensor([video]),
                     torch.tensor([1.0]))  # 2 frames per grid at 2 fps
    assert pos.shape[1] > 500 and int(pos.max()) > 100
    return pos[:, None]


@pytest.mark.parametrize("model_type", list(REAL))
def test_real_layout_matches_transformers(model_type):
    _compare(model_type, _real_positions(model_type), 0, f"{model_type} real layout", REAL[model_type])


def test_pass_through_and_axis():
    """Partial rotary leaves the channels past rot_dim untouched; the axis maps of both layouts."""
    assert mrope_axis([2, 3, 3], False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert mrope_axis([2, 3, 3], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axis([24, 20, 20], True).tolist() == [0] + [1, 2, 0] * 20 + [0, 0, 0]
    pos = _batch_positions("qwen3_5", seed=5)[0]
    q, k, gq, gk = _qkg(*pos.shape[1:], 64, seed=3)
    out = _run_ours("qwen3_5", pos, q, k, gq, gk, torch.float64)
    assert torch.equal(out[0][..., 16:], q[..., 16:]) and torch.equal(out[2][..., 16:], gq[..., 16:])
    assert not torch.allclose(out[0][..., :16], q[..., :16])


def test_module_state():
    """No state in the state dict, inv_freq stays fp32 under a bf16 cast, packed defaults to False,
    GPTModel's call (positions, section, cp_group=) and newer keyword arguments are accepted."""
    module = _ours("qwen3_vl")
    assert module.packed is False and not module.state_dict() and module.inv_freq.dtype == torch.float32
    pos = _batch_positions("qwen3_vl", seed=1)[1]
    want = module(pos)
    module.bfloat16()
    assert torch.equal(module(pos, [4, 4, 4], cp_group=None, packed_seq=True, extra="ignored"), want)
    assert torch.equal(module(pos.int()), want)
    module.packed = True  # CP = 1: no cut either way
    assert torch.equal(module(pos), want)
    other = MultimodalRotaryEmbedding(24, 1.0, 5e5, [6, 3, 3], True)  # a section given to forward wins
    assert torch.equal(module(pos, [6, 3, 3]), other(pos)) and not torch.equal(other(pos), want)


def test_bad_input():
    with pytest.raises(ValueError, match=r"mrope_section must be three ints .* summing to rot_dim / 2 = 8"):
        MultimodalRotaryEmbedding(16, 1.0, 1e4, [2, 3, 2], False)
    with pytest.raises(ValueError, match="mrope_section must be three ints"):
        MultimodalRotaryEmbedding(16, 1.0, 1e4, [4, 4], False)
    with pytest.raises(ValueError, match="rot_dim = int"):
        MultimodalRotaryEmbedding(6, 0.5, 1e4, [1, 0, 0], False)
    module = _ours("qwen2_5_vl")
    for pos in (torch.zeros(2, 1, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long),
                torch.zeros(3, 1, 4)):
        with pytest.raises(ValueError, match=r"position_ids must be an integer tensor \[3, b, s\]"):
            module(pos)
    with pytest.raises(ValueError, match="mrope_section must be three ints"):
        module(torch.zeros(3, 1, 4, dtype=torch.long), [4, 2, 3])


def _thd_check(model_type: str, lengths: list[int], seed: int, dtype=torch.float64) -> None:
    """A thd pack through apply_rotary_pos_emb with cu_seqlens equals each sequence alone (bshd)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    rng = random.Random(seed)
    d = SHAPES[model_type][0]
    seqs = [_sample_positions(rng, model_type, n) for n in lengths]
    pack = torch.cat(seqs, dim=1)[:, None]  # [3, 1, T]
    module = _ours(model_type)
    module.packed = True
    freqs = module(pack)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, _, gq, _ = _qkg(1, sum(lengths), d, seed=seed)
    t = q[0].to(dtype).requires_grad_()
    out = apply_rotary_pos_emb(t, freqs, _megatron_config(model_type), cu_seqlens=cu, cp_group=_OneRank())
    (out * gq[0].to(dtype)).sum().backward()
    start = 0
    for n, pos in zip(lengths, seqs, strict=True):
        sl = slice(start, start + n)
        alone = _run_hf(model_type, pos[:, None], q[:, sl], q[:, sl], gq[:, sl], gq[:, sl], dtype)
        assert_rel_close(out[sl], alone[0][0], REL_TOL[dtype], f"{model_type} thd sequence at {start}")
        assert_rel_close(t.grad[sl], alone[2][0], REL_TOL[dtype], f"{model_type} thd dq at {start}")
        start += n


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_5"])
def test_thd_pack_equals_sequences_alone(model_type):
    _thd_check(model_type, [40, 64, 33], seed=7)
    _thd_check(model_type, [64, 64], seed=8, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks: CP = 2 against CP = 1
# ----------------------------------------------------------------------------------------------------
def _slots(lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Global token indices this CP rank holds: chunks ``rank`` and ``2 cp - 1 - rank`` of each sequence."""
    out, start = [], 0
    for n in lengths:
        c = n // (2 * cp)
        out += [*range(start + rank * c, start + (rank + 1) * c),
                *range(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c)]
        start += n
    return torch.tensor(out)


def _apply(t, freqs, config, group, cu=None, grad=None):
    """apply_rotary_pos_emb on a float64 copy of ``t``: output and the gradient of ``(out * grad).sum()``."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    t = t.detach().clone().requires_grad_()
    out = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
    (out * grad).sum().backward()
    return out.detach(), t.grad


class _Stop(Exception):
    """Raised by the decoder pre-hook once GPTModel has computed the rotary embedding."""


@functools.cache
def _gpt(model_type: str):
    """A one-layer GPTModel with position_embedding_type "mrope" whose decoder pre-hook stores its
    keyword arguments in ``model.captured`` and stops the forward (built once per rank process)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    d, fraction, section, theta = SHAPES[model_type]
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * d, num_attention_heads=HEADS, kv_channels=d,
                               use_cpu_initialization=True, mrope_section=section)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=256,
                     position_embedding_type="mrope", rotary_percent=fraction, rotary_base=int(theta))
    model.captured = {}

    def hook(_module, _args, kwargs):
        model.captured = kwargs
        raise _Stop

    model.decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def _gpt_rotary(model_type: str, module, input_ids, position_ids, packed=None):
    """The ``rotary_pos_emb`` GPTModel's own forward hands its decoder with ``module`` as its
    rotary_pos_emb."""
    model = _gpt(model_type)
    model.rotary_pos_emb = module
    with pytest.raises(_Stop):
        model(input_ids, position_ids, None, packed_seq_params=packed)
    return model.captured["rotary_pos_emb"]


def _cp2_checks(rank: int, world: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_engine.parallel.cpu_device import apply_cpu_device_layer

    apply_cpu_device_layer()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    group = parallel_state.get_context_parallel_group()
    assert group.size() == world == 2 and group.rank() == rank
    one = _OneRank()
    for model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        d = SHAPES[model_type][0]
        config = _megatron_config(model_type)
        # --- 1. bshd: this rank's chunks of the CP = 1 freqs; values and gradients at those slots ---
        for i, pos in enumerate(_batch_positions(model_type, seed=11, b=2, s=96)):
            b, s = pos.shape[1:]
            full = _ours(model_type, cp_group=one)(pos)
            local = _ours(model_type)(pos)
            slots = _slots([s], world, rank)
            assert torch.equal(local, full[slots]), f"{model_type} bshd freqs cut (positions {i})"
            assert torch.equal(_ours(model_type, cp_group=one)(pos, cp_group=group), local)
            ids = torch.zeros(b, s // world, dtype=torch.long)
            assert torch.equal(_gpt_rotary(model_type, _ours(model_type), ids, pos), local)
            q, _, g, _ = (x.transpose(0, 1) for x in _qkg(b, s, d, seed=i))  # [s, b, h, d]
            ref = _apply(q, full, config, one, grad=g)
            got = _apply(q[slots], local, config, group, grad=g[slots])
            for name, a, e in zip(("out", "dq"), got, ref, strict=True):
                assert_rel_close(a, e[slots], REL_TOL[torch.float64], f"{model_type} bshd CP=2 {name}")
        # --- 2. thd: the whole pack's freqs; Megatron cuts them per sequence and rank ---
        lengths = [32, 48, 16]
        rng = random.Random(5)  # the same pack on both ranks
        pack = torch.cat([_sample_positions(rng, model_type, n) for n in lengths], dim=1)[:, None]
        whole = _ours(model_type, cp_group=one)(pack)
        module = _ours(model_type)
        module.packed = True
        assert torch.equal(module(pack), whole), f"{model_type} thd freqs must stay whole"
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_kv=max(lengths))
        slots = _slots(lengths, world, rank)
        assert torch.equal(_gpt_rotary(model_type, module, torch.zeros(1, len(slots), dtype=torch.long), pack,
                                       packed), whole)
        q, _, g, _ = _qkg(1, sum(lengths), d, seed=3)
        ref = _apply(q[0], whole, config, one, cu, g[0])
        got = _apply(q[0][slots], module(pack), config, group, cu, g[0][slots])
        for name, a, e in zip(("out", "dq"), got, ref, strict=True):
            assert_rel_close(a, e[slots], REL_TOL[torch.float64], f"{model_type} thd CP=2 {name}")
    # --- 3. text positions (t = h = w): Megatron's RotaryEmbedding at CP = 1 and its CP = 2 cut ---
    for model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        d, fraction, _, theta = SHAPES[model_type]
        pos = torch.arange(40).expand(3, 2, 40)
        ref = RotaryEmbedding(d, fraction, rotary_base=theta, use_cpu_initialization=True)
        assert torch.equal(_ours(model_type, cp_group=one)(pos), ref(40, cp_group=one).expand(40, 2, 1, -1))
        assert torch.equal(_ours(model_type)(pos), ref(40, cp_group=group).expand(20, 2, 1, -1))


def test_cp2_matches_cp1():
    run_distributed(_cp2_checks, 2)
