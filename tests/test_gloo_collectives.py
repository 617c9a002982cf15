"""mcore_engine.parallel.gloo_collectives on two gloo ranks: unequal all-gathers and tensor split sizes give
what the collectives mean (each rank's own rows, in rank order), sync and async, fp32 and bf16."""

from __future__ import annotations

import torch

from tests.utils import run_distributed


def _collectives(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from mcore_engine.parallel.gloo_collectives import apply_gloo_collectives

    apply_gloo_collectives()
    sizes = [3, 5]
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(7)
        rows = [torch.randn(n, 4, 2, generator=g).to(dtype) for n in sizes]  # the same on both ranks
        for async_op in (False, True):
            out = list(torch.full((sum(sizes), 4, 2), float("nan"), dtype=dtype).split(sizes))
            work = dist.all_gather(out, rows[rank], async_op=async_op)
            if async_op:
                work.wait()
            for got, want in zip(out, rows, strict=True):
                assert torch.equal(got, want), f"unequal all_gather {dtype} async={async_op}"
        equal = [torch.empty(3, 4, 2, dtype=dtype) for _ in range(world_size)]
        dist.all_gather(equal, rows[0] + rank)
        assert all(torch.equal(e, rows[0] + r) for r, e in enumerate(equal)), "equal all_gather"
    # all_to_all_single with tensor split sizes (the MoE dispatcher's habit)
    send = torch.arange(6, dtype=torch.float32) + 10 * rank
    splits = torch.tensor([2, 4]) if rank == 0 else torch.tensor([1, 5])
    recv_splits = torch.tensor([2, 1]) if rank == 0 else torch.tensor([4, 5])
    recv = torch.empty(int(recv_splits.sum()))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=splits)
    want = torch.tensor([0.0, 1.0, 10.0]) if rank == 0 else torch.tensor([2.0, 3, 4, 5, 11, 12, 13, 14, 15])
    assert torch.equal(recv, want), recv


def test_gloo_collectives_two_ranks():
    run_distributed(_collectives, 2)
