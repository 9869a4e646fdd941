"""sm_90 compile report for split-K tiles, without a GPU: registers, stack (spills) and instruction
counts of the batch-invariant in-program kernel, split-order sum vs exact fixed-point sum.

    python benchmarks/compile_probe.py    # needs Triton's bundled ptxas/cuobjdump (any machine)

Compiles ``_splitk_partials_kernel`` ahead of time for sm_90 (K split 512 = 14 splits of K=7168)
and prints, per tile: registers, stack bytes, HGMMA (wgmma), F2I / I2F (the fixed-point
conversions) in the SASS.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.router_gemm_splitk import _splitk_partials_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ARGS = ["x_ptr", "w_ptr", "part_ptr", "out_ptr", "ticket_ptr", "fix_ptr", "M", "N", "K"]
ARGS += ["stride_xm", "stride_wn", "stride_ps", "stride_pm", "stride_om"]
CONSTS = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "K_PER_SPLIT", "SPLIT_K", "PROMOTE_CHUNKS", "DOT_MODE"]
CONSTS += ["UPCAST", "TICKET", "UNROLL", "SPLITS_IN_PROGRAM", "FIXED_POINT"]


def report(block_m: int, block_n: int, block_k: int, promote: int, warps: int, fixed: bool) -> str:
    types = ["*bf16", "*bf16", "*i64" if fixed else "*fp32", "*fp32", "*i32", "*i64"] + ["i32"] * 8
    signature = dict(zip(ARGS, types, strict=True)) | dict.fromkeys(CONSTS, "constexpr")
    values = [block_m, block_n, block_k, 512, 14, promote, 0, False, False, False, True, fixed]
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)}
    src = ASTSource(_splitk_partials_kernel, signature, dict(zip(CONSTS, values, strict=True)), aligned)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.findall(r"REG:(\d+)", usage)
    stack = re.findall(r"STACK:(\d+)", usage)
    return (
        f"{block_m}x{block_n} BLOCK_K {block_k} promote {promote} warps {warps} "
        f"{'fixed-point' if fixed else 'split-order'}: regs {regs} stack {stack} "
        f"HGMMA {sass.count('HGMMA')} F2I {sass.count('F2I')} I2F {sass.count('I2F')}"
    )


def main() -> int:
    for fixed in (False, True):
        for block_m, block_n, warps in ((128, 128, 8), (128, 64, 4), (128, 64, 8), (64, 128, 4), (64, 64, 4)):
            for block_k, promote in ((128, 4), (64, 2)):  # bf16-fp32out, fp32 mode
                print(report(block_m, block_n, block_k, promote, warps, fixed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
