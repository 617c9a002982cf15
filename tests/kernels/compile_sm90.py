"""Compile every kernel variant for sm_90: ``python -m tests.kernels.compile_sm90`` (interpreter off).

Prints "compiled" on success; a kernel whose arguments drift from the signatures below fails with KeyError.
"""

from __future__ import annotations

import triton
from mcore_engine_kernels import backward, forward
from mcore_engine_kernels.launch import DEFAULT_CONFIGS, LaunchConfig
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
STATS_PTRS = ("t_ptr", "m_ptr", "inv_s_ptr", "a_ptr", "b_ptr", "mu_ptr", "c2_ptr", "pval_ptr", "part_ptr",
              "a_tail_ptr")


def compile_(fn, ptrs: dict[str, str], consts: dict, cfg: LaunchConfig, nones: tuple[str, ...] = ()) -> None:
    """Compile ``fn`` with pointer types ``ptrs`` (other pointers fp32), int32 ints and ``consts``.

    ``nones``: pointer arguments the launchers pass as None in this variant (Triton makes them
    constexpr None at run time, so they are compiled that way here too).
    """
    types = {**{p: "*fp32" for p in STATS_PTRS}, **ptrs, "t_scalar": "fp32"}
    consts = {**consts, "BLOCK_V": cfg.block_v, **dict.fromkeys(nones)}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    assert "cubin" in triton.compile(src, target=TARGET, options={"num_warps": cfg.num_warps}).asm


def main() -> None:
    for dt, t_mode, k in (("fp32", 2, 5), ("bf16", 1, 0), ("fp16", 0, 3)):
        x = {"x_ptr": f"*{dt}"}
        no_t = () if t_mode == 2 else ("t_ptr",)
        compile_(forward._row_max_kernel, x, {"T_MODE": t_mode}, DEFAULT_CONFIGS["row_max"], no_t)
        ids = {"ycol_ptr": "*i64", "yin_ptr": "*i1", "tcol_ptr": "*i64", "tin_ptr": "*i1", "out_ptr": "*fp32"}
        cols = {"COL_SUM_EZ": 1, "COL_SUM_E2": 2 if k else -1, "COL_LABEL": 3 if k else -1,
                "COL_TEACHER": 4, "K": k, "COL_TAIL": 4 + k if k else -1}
        no_ids = () if k else ("ycol_ptr", "yin_ptr", "tcol_ptr", "tin_ptr")
        compile_(forward._chunk_stats_kernel, {**x, **ids}, {**cols, "T_MODE": t_mode},
                 DEFAULT_CONFIGS["chunk_stats"], no_t + no_ids)
        flags = {"HAS_B": bool(k), "HAS_C2": not k, "N_PTS": k, "N_TAIL": k, "T_MODE": t_mode,
                 "EMULATE_RTNE": dt == "bf16"}
        no_terms = ("c2_ptr",) if k else ("b_ptr", "mu_ptr", "pcol_ptr", "pval_ptr", "a_tail_ptr", "tcol_ptr")
        pts = {"pcol_ptr": "*i64", "tcol_ptr": "*i64", "out_ptr": f"*{dt}"}
        compile_(backward._chunk_grad_kernel, {**x, **pts}, flags, DEFAULT_CONFIGS["chunk_grad"],
                 no_t + no_terms)
    print("compiled")


if __name__ == "__main__":
    main()
