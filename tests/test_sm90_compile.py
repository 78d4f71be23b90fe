"""The glue kernels compiled for an H200 (sm_90) on a machine without a GPU: Triton's front end and
ptxas (bundled with Triton) run ahead of time, so a kernel that the interpreter runs but the
compiler refuses (a loop-carried value that changes shape, a dtype mismatch) fails here, not on
the GPU. The compiles run in one subprocess without ``TRITON_INTERPRET`` (under the interpreter
the kernels are not compilable objects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOPK_TYPES = dict(LOGITS="*bf16", BIAS="*fp32", IDS="*i64", WEIGHTS="*fp32", T="i32", stride_l="i32", scaling="fp32")
SLOT_TYPES = dict(IDS="*i64", HIST="*i32", SHIFT="*i64", OFFS="*i32", POS="*i64", MIDX="*i32", COUNTS="*i32",
                  N_SLOTS="i32", E="i32", M_ROWS="i32", NUM_BLOCKS="i32", BLOCK="i32", X="*u8", XS="*fp32", Y="*u8",
                  YS="*fp32", H="i32", S="i32", stride_xm="i32", stride_xsm="i32", stride_ym="i32", stride_ysm="i32",
                  stride_ysc="i32")  # fmt: skip
QUANT_TYPES = dict(X="*bf16", XS="*fp32", Q="*fp8e4nv", S="*fp32", MASKED_M="*i32", ROW_EXPERT="*i32", M="i32", K="i32",
                   CAP="i32", PROGS="i32", stride_xm="i32", stride_xsm="i32", stride_qm="i32", stride_sm="i32",
                   stride_sg="i32")  # fmt: skip
SCATTER_TYPES = dict(X="*u8", XS="*fp32", Y="*u8", YS="*fp32", POS="*i64", H="i32", S="i32", stride_xm="i32",
                     stride_xsm="i32", stride_ym="i32", stride_ysm="i32", stride_ysc="i32")
GATHER_TYPES = dict(X="*bf16", POS="*i64", W="*fp32", OUT="*bf16", H="i32", stride_xm="i32", stride_om="i32")
PREP_TYPES = dict(LOGITS="*fp32", BIAS="*fp32", X="*bf16", IDS="*i64", WEIGHTS="*fp32", OFFS="*i32", POS="*i64",
                  MIDX="*i32", COUNTS="*i32", Y="*i8", YS="*fp32", T="i32", H="i32", M_ROWS="i32", stride_l="i32",
                  stride_xm="i32", stride_ym="i32", stride_ysm="i32", stride_ysc="i32", scaling="fp32")  # fmt: skip
FLAT_128 = dict(E=128, E_PAD=128, K=8, K_PAD=8, SIGMOID=False, HAS_BIAS=False, RENORM=True, GROUPED=False, GROUPS=1,
                G_PAD=1, PER_GROUP=128, TOPK_GROUP=1)  # fmt: skip
V3_256 = dict(E=256, E_PAD=256, K=8, K_PAD=8, SIGMOID=True, HAS_BIAS=True, RENORM=True, GROUPED=True, GROUPS=8,
              G_PAD=8, PER_GROUP=32, TOPK_GROUP=4)  # fmt: skip
PREP_LAYOUT = dict(TILE_ROWS=32, ROW_STEP=1024, GROUP=128, ROW_BLOCK=8192)
SILU_TYPES = dict(X="*bf16", Y="*bf16", MASKED_M="*i32", M="i32", I="i32", CAP="i32", PROGS="i32", stride_xm="i32",
                  stride_ym="i32")  # fmt: skip
GEMM_TYPES = dict(A="*i8", B="*i8", C="*bf16", AS="*fp32", BS="*fp32", SEG="*i32", N="i32", K="i32", E="i32", CAP="i32",
                  GRID_M="i32", stride_am="i32", stride_be="i32", stride_bn="i32", stride_cm="i32", stride_asm="i32",
                  stride_ask="i32", stride_bse="i32", stride_bsn="i32", stride_bsk="i32")  # fmt: skip

CASES = {
    # name: (module, kernel, argument types, constexprs)
    "topk_deepseek_v3": ("epmoe.kernels.topk", "_fused_topk_kernel", TOPK_TYPES, dict(
        E=256, E_PAD=256, K=8, K_PAD=8, BLOCK_T=4, SIGMOID=True, HAS_BIAS=True, RENORM=True, GROUPED=True, GROUPS=8,
        G_PAD=8, PER_GROUP=32, TOPK_GROUP=4, RANK=False)),
    "topk_grouped_rows": ("epmoe.kernels.topk", "_fused_topk_kernel", TOPK_TYPES, dict(
        E=64, E_PAD=64, K=6, K_PAD=8, BLOCK_T=16, SIGMOID=False, HAS_BIAS=False, RENORM=False, GROUPED=True, GROUPS=8,
        G_PAD=8, PER_GROUP=8, TOPK_GROUP=3, RANK=False)),
    "topk_decode_softmax": ("epmoe.kernels.topk", "_fused_topk_kernel", TOPK_TYPES, dict(
        E=128, E_PAD=128, K=8, K_PAD=8, BLOCK_T=1, SIGMOID=False, HAS_BIAS=False, RENORM=True, GROUPED=False, GROUPS=1,
        G_PAD=1, PER_GROUP=128, TOPK_GROUP=1, RANK=False)),
    "slot_layout_with_copy": ("epmoe.kernels.permute", "_slot_positions_kernel", SLOT_TYPES, dict(
        STEP=128, TILE_ROWS=32, ROW_STEP=1024, ALIGN=128, E_PAD=128, TOPK=8, BLOCK_H=32, SIZES_ON_DEVICE=True,
        ONE_BLOCK=True, COPY=True, HAS_SCALE=True)),
    "slot_layout_one_block": ("epmoe.kernels.permute", "_slot_positions_kernel", SLOT_TYPES, dict(
        STEP=128, TILE_ROWS=32, ROW_STEP=1024, ALIGN=1, E_PAD=128, TOPK=8, BLOCK_H=1, SIZES_ON_DEVICE=True,
        ONE_BLOCK=True, COPY=False, HAS_SCALE=False)),
    "row_masked_group_quant": ("epmoe.kernels.quantize", "group_quant_kernel", QUANT_TYPES, dict(
        QMAX=448.0, TO_E4M3=True, HAS_XS=False, HAS_MASK=True, HAS_ROW_MASK=True, IN_GROUP=1, SILU=True, GROUP=128,
        BLOCK_M=4, BLOCK_K=512, PDL=False)),
    # The dense INT8 path's quantizers as programmatic dependents (dependent_start): int8 codes.
    "pdl_token_quant": ("epmoe.kernels.quantize", "token_quant_kernel", {**QUANT_TYPES, "Q": "*i8"}, dict(
        QMAX=127.0, HAS_XS=False, HAS_MASK=False, HAS_ROW_MASK=False, IN_GROUP=1, SILU=False, GROUP=128, BLOCK_M=1,
        BLOCK_K=8192, SINGLE=True, PDL=True)),
    "pdl_group_quant": ("epmoe.kernels.quantize", "group_quant_kernel", {**QUANT_TYPES, "Q": "*i8"}, dict(
        QMAX=127.0, TO_E4M3=False, HAS_XS=False, HAS_MASK=False, HAS_ROW_MASK=False, IN_GROUP=1, SILU=False,
        GROUP=128, BLOCK_M=1, BLOCK_K=1024, PDL=True)),
    "scatter_rows": ("epmoe.kernels.permute", "_scatter_rows_kernel", SCATTER_TYPES, dict(
        TOPK=8, HAS_SCALE=True, BLOCK_H=128, BLOCK_S=64)),
    "gather_weighted": ("epmoe.kernels.permute", "_gather_weighted_kernel", GATHER_TYPES, dict(
        TOPK=8, BLOCK_H=128, PDL=False)),
    # A decode step's chain as programmatic dependents (pdl.dependent_start): the gather, the
    # activation, the grouped GEMM (int8 channel, int32 accumulator, a decode tile) and the prep.
    "pdl_gather_weighted": ("epmoe.kernels.permute", "_gather_weighted_kernel", GATHER_TYPES, dict(
        TOPK=8, BLOCK_H=128, PDL=True)),
    "pdl_silu_mul": ("epmoe.kernels.activation", "_silu_mul_kernel", SILU_TYPES, dict(
        HAS_MASK=False, GROUP=128, BLOCK_M=1, BLOCK_K=2048, PDL=True)),
    "pdl_grouped_gemm": ("epmoe.kernels.grouped_gemm", "_grouped_gemm_kernel", GEMM_TYPES, dict(
        MODE=2, MASKED=False, E_PAD=128, FP32_IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, SWAP_AB=True,
        EVEN_K=True, SCALE_BLOCK=128, PDL=True)),
    # The int8_block K step, which reads the activation scales through both strides (MN-major ones
    # from the layer's scatter, row-major ones from elsewhere).
    "pdl_grouped_gemm_int8_block": ("epmoe.kernels.grouped_gemm", "_grouped_gemm_kernel", GEMM_TYPES, dict(
        MODE=3, MASKED=False, E_PAD=128, FP32_IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SWAP_AB=True,
        EVEN_K=True, SCALE_BLOCK=128, PDL=True)),
    "pdl_prep_one_token_int8_token": ("epmoe.kernels.prep", "_decode_prep_kernel", PREP_TYPES, dict(
        **FLAT_128, **PREP_LAYOUT, BLOCK_T=1, RANK=True, ALIGN=1, QUANT=1, QMAX=127.0, TO_E4M3=False, BLOCK_H=128,
        PDL=True)),
    # The routing by rank (topk.by_rank) of one token, grouped.
    "topk_rank_grouped": ("epmoe.kernels.topk", "_fused_topk_kernel", TOPK_TYPES, dict(
        E=128, E_PAD=128, K=8, K_PAD=8, BLOCK_T=1, SIGMOID=True, HAS_BIAS=True, RENORM=True, GROUPED=True, GROUPS=8,
        G_PAD=8, PER_GROUP=16, TOPK_GROUP=4, RANK=True)),
    # The decode prep (kernels/prep.py): every payload; the routing by rank (one token of 128 experts,
    # the benchmarks' decode step; 4 tokens of 64 grouped) and by rounds (256 experts; 16 tokens).
    "prep_one_token_int8_token": ("epmoe.kernels.prep", "_decode_prep_kernel", PREP_TYPES, dict(
        **FLAT_128, **PREP_LAYOUT, BLOCK_T=1, RANK=True, ALIGN=1, QUANT=1, QMAX=127.0, TO_E4M3=False, BLOCK_H=128,
        PDL=False)),
    "prep_one_token_v3_fp8_group": ("epmoe.kernels.prep", "_decode_prep_kernel", dict(PREP_TYPES, Y="*fp8e4nv"),
        dict(**V3_256, **PREP_LAYOUT, BLOCK_T=1, RANK=False, ALIGN=128, QUANT=2, QMAX=448.0, TO_E4M3=True,
             BLOCK_H=128, PDL=False)),
    "prep_grouped_rank_bf16": ("epmoe.kernels.prep", "_decode_prep_kernel", dict(PREP_TYPES, Y="*bf16"), dict(
        V3_256, **PREP_LAYOUT, E=64, E_PAD=64, K=6, PER_GROUP=8, TOPK_GROUP=3, BLOCK_T=4, RANK=True, ALIGN=1, QUANT=0,
        QMAX=1.0, TO_E4M3=False, BLOCK_H=256, PDL=False)),
    "prep_16_tokens_int8_group": ("epmoe.kernels.prep", "_decode_prep_kernel", PREP_TYPES, dict(
        **FLAT_128, **PREP_LAYOUT, BLOCK_T=16, RANK=False, ALIGN=4, QUANT=2, QMAX=127.0, TO_E4M3=False, BLOCK_H=1024,
        PDL=False)),
}  # fmt: skip

_SCRIPT = """
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = {}
for name, (module, kernel, types, consts) in json.loads(sys.argv[1]).items():
    fn = getattr(importlib.import_module(module), kernel)
    try:
        sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4}).asm["ptx"]
        trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
        # A programmatic dependent lets its dependent launch before it waits, and touches no global
        # memory before its wait (what a predecessor writes or still reads).
        early = re.search(r"\\b(ld\\.global|st\\.global|atom\\.|red\\.|cp\\.async)", ptx[:wait]) if wait > -1 else None
        if bool(consts.get("PDL")) != (-1 < trigger < wait):
            out[name] = f"trigger at {trigger}, wait at {wait}"
        else:
            out[name] = f"{early.group(0)} before the wait" if early else "ok"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    if run.returncode:
        pytest.fail(f"the compile subprocess failed:\n{run.stderr[-3000:]}")
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if all("ptxas" in r or "backend" in r.lower() for r in results.values() if r != "ok") and "ok" not in results.values():
        pytest.skip(f"Triton cannot compile for sm_90 here: {next(iter(results.values()))}")
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_glue_kernel_compiles_for_sm90(name, compiled):
    assert compiled[name] == "ok", compiled[name]
