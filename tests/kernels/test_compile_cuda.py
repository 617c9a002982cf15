"""Every kernel variant compiles for a real GPU (sm_90 cubin via Triton's bundled ptxas), no GPU needed.

The interpreter runs kernels as Python and accepts things the compiler rejects; this catches those.
It runs in a subprocess without ``TRITON_INTERPRET`` and with a fresh Triton cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mcore_engine_kernels import backward, forward
    from mcore_engine_kernels.launch import DEFAULT_CONFIGS

    TARGET = GPUTarget("cuda", 90, 32)

    def compile_(fn, ptrs, ints, consts, cfg):
        sig = {**ptrs, **{n: "i32" for n in ints}, "t_scalar": "fp32", "BLOCK_V": "constexpr",
               **{c: "constexpr" for c in consts}}
        sig = {n: sig[n] for n in fn.arg_names}  # every kernel argument, in order (KeyError: drift)
        src = ASTSource(fn=fn, signature=sig, constexprs={**consts, "BLOCK_V": cfg.block_v})
        assert "cubin" in triton.compile(src, target=TARGET, options={"num_warps": cfg.num_warps}).asm

    for dt, t_mode in zip(("fp32", "bf16", "fp16"), (0, 1, 2)):
        common = {"x_ptr": f"*{dt}", "t_ptr": "*fp32"}
        compile_(forward._row_max_kernel, {**common, "part_ptr": "*fp32"},
                 ("stride_xr", "stride_xc", "n_cols", "cols_per_split"), {"T_MODE": t_mode},
                 DEFAULT_CONFIGS["row_max"])
        for k, tail in ((0, False), (5, True)):
            compile_(forward._chunk_stats_kernel,
                     {**common, "m_ptr": "*fp32", "ycol_ptr": "*i64", "yin_ptr": "*i1", "tcol_ptr": "*i64",
                      "tin_ptr": "*i1", "out_ptr": "*fp32"},
                     ("stride_xr", "stride_xc", "stride_tr", "stride_tk", "stride_or", "stride_os", "n_cols",
                      "cols_per_split"),
                     {"COL_A": 1, "COL_B": 2, "COL_Y": 3, "COL_TEACHER": 4, "K": k, "COL_TAIL": 4 + k if tail else -1,
                      "T_MODE": t_mode}, DEFAULT_CONFIGS["chunk_stats"])
        for has_b, n_pts in ((True, 6), (False, 0)):
            compile_(backward._chunk_grad_kernel,
                     {**common, **{p: "*fp32" for p in ("m_ptr", "inv_s_ptr", "a_ptr", "b_ptr", "mu_ptr", "c2_ptr",
                                                       "pval_ptr")}, "pcol_ptr": "*i64", "out_ptr": f"*{dt}"},
                     ("stride_xr", "stride_xc", "stride_pr", "stride_pk", "stride_vr", "stride_vk", "stride_or",
                      "stride_oc", "n_cols", "cols_per_split"),
                     {"HAS_B": has_b, "HAS_C2": not has_b, "N_PTS": n_pts, "T_MODE": t_mode, "EMULATE_RTNE": False},
                     DEFAULT_CONFIGS["chunk_grad"])
    print("compiled")
''')


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]
