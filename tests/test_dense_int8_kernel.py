"""The small-batch W8A8 INT8 dense kernel (epmoe.kernels.dense_int8) under the interpreter,
against float64 references that quantize the activations on their own (test_linear's
``ref_quant_rows``), fused and unfused, both schemes, both accumulators, with and without bias."""

from __future__ import annotations

import pytest
import torch

from epmoe.kernels.dense_int8 import SmallMConfig, dense_int8_small_m, small_m_config, split_plan
from test_linear import ref_quant_rows  # tests/ is on sys.path (conftest)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 output; a rare activation code on the other side of a rounding boundary between the fp32
# quantizer and the float64 one (~1e-4 of the norm): far below the ~1e-2 of quantization itself.
TIGHT = 1e-3
CASES = [("int8_channel", "int32"), ("int8_channel", "fp32"), ("int8_block", "fp32")]


def _weights(n, k, scheme, gen):
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    shape = (n, 1) if scheme == "int8_channel" else (-(-n // 128), k // 128)
    ws = torch.rand(shape, generator=gen) * 1e-2 + 1e-3
    return w, ws


def _ref(x, w, ws, bias, scheme):
    if scheme == "int8_channel":
        wf = w.double() * ws.double()
        xq = ref_quant_rows(x, None)
    else:
        full = ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        wf = w.double() * full
        xq = ref_quant_rows(x, 128)
    out = xq @ wf.t()
    return out if bias is None else out + bias.double()


def _rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


@pytest.mark.parametrize("scheme,acc", CASES, ids=["channel-int32", "channel-fp32", "block"])
# 72 rows: two blocks of 64, the second partial (what 1000 rows, 16 blocks, exercised at several
# times the interpreter time); 128 fills its blocks, 1 and 7 fill part of one block of 16.
@pytest.mark.parametrize("m", [1, 7, 128, 72])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_small_m_kernel_against_float64(scheme, acc, m, fused):
    gen = torch.Generator().manual_seed(m)
    n, k = 40, 256  # N not a multiple of the tile: masked stores
    w, ws = _weights(n, k, scheme, gen)
    x = torch.randn(m, k, generator=gen)
    x[0, 3] = 9.0  # an outlier sets row 0's scale
    bias = torch.randn(n, generator=gen) if m % 2 else None
    cfg = SmallMConfig(16 if m <= 16 else 64, 16, 256, 4, 2, fused)  # block: two scale blocks per K step
    out = dense_int8_small_m(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), None if bias is None else bias.to(DEVICE),
                             scheme=scheme, accumulator=acc, config=cfg)  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert _rel(out, _ref(x, w, ws, bias, scheme)) <= TIGHT


@pytest.mark.parametrize("scheme,acc", CASES, ids=["channel-int32", "channel-fp32", "block"])
def test_fused_equals_quantize_then_gemm(scheme, acc):
    """The fused kernel forms the very codes of the quantizer kernel: equal outputs (int32: the
    same exact sum; fp32: the same K steps)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 384
    w, ws = _weights(n, k, scheme, gen)
    x = (torch.randn(3, k, generator=gen) * 3).to(DEVICE)
    args = (w.to(DEVICE), ws.to(DEVICE))
    fused = dense_int8_small_m(x, *args, scheme=scheme, accumulator=acc, config=SmallMConfig(16, 16, 128, 4, 2, True))
    plain = dense_int8_small_m(x, *args, scheme=scheme, accumulator=acc, config=SmallMConfig(16, 16, 128, 4, 2, False))
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def _fp16_channel(seed, n, k, m, config=None):
    """One channel int32 call of fp16 ``[m, k]`` activations, checked (fp16 out, within 2e-3 of
    the float64 reference); returns the output and the call's device tensors."""
    gen = torch.Generator().manual_seed(seed)
    w, ws = _weights(n, k, "int8_channel", gen)
    x = torch.randn(m, k, generator=gen).half()
    dev = tuple(t.to(DEVICE) for t in (x, w, ws))
    out = dense_int8_small_m(*dev, scheme="int8_channel", accumulator="int32", config=config)
    assert out.dtype == torch.float16
    assert _rel(out, _ref(x.float(), w, ws, None, "int8_channel")) <= 2e-3
    return out, dev


def test_uneven_k_and_fp16_output():
    """Channel K not a multiple of the K tile (masked K loads), fp16 in and out, default config."""
    _fp16_channel(2, 33, 200, 5)


def test_refusals():
    w = torch.zeros(16, 128, dtype=torch.int8, device=DEVICE)
    ws = torch.ones(16, 1, device=DEVICE)
    x = torch.zeros(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="scheme="):
        dense_int8_small_m(x, w, ws, scheme="fp8", accumulator="fp32")
    with pytest.raises(ValueError, match="accumulator='int32'"):
        dense_int8_small_m(x, w, torch.ones(1, 1, device=DEVICE), scheme="int8_block", accumulator="int32")
    with pytest.raises(ValueError, match="weight:"):
        dense_int8_small_m(torch.zeros(2, 64, device=DEVICE), w, ws, scheme="int8_channel", accumulator="int32")
    with pytest.raises(ValueError, match="x_scale"):
        dense_int8_small_m(x.to(torch.int8), w, ws, scheme="int8_channel", accumulator="int32")
    with pytest.raises(ValueError, match="fused"):
        dense_int8_small_m(x.to(torch.int8), w, ws, scheme="int8_channel", accumulator="int32",
                           x_scale=torch.ones(2, 1, device=DEVICE), config=SmallMConfig(16, 16, 128, 4, 2, True))  # fmt: skip


def test_config_rule():
    """Narrow N tiles until two programs per SM (never narrower than half the row tile); K split
    where even the narrowest tiles leave fewer programs than that; fused only for the channel
    scheme, at a few rows, while the activations a program reads stay within its weight bytes
    (twice them when K is split); longer K steps and deeper stages where programs have SMs to
    themselves."""
    sms = 132
    assert small_m_config(1, 576, 7168, "int8_channel", sms) == (16, 16, 512, 4, 5, True, 8, 1, False, 0)  # kv_a: 36 N tiles
    assert split_plan(7168, small_m_config(1, 576, 7168, "int8_channel", sms)) == (1024, 7)
    assert small_m_config(16, 576, 7168, "int8_channel", sms) == (16, 16, 512, 4, 4, False, 8, 1, False, 0)
    assert small_m_config(64, 576, 7168, "int8_channel", sms)[:2] == (64, 32)
    assert small_m_config(16, 36864, 7168, "int8_channel", sms) == (16, 128, 128, 4, 4, False, 1, 1, False, 0)  # 288 programs
    assert small_m_config(4, 36864, 7168, "int8_channel", sms).fused is True
    assert small_m_config(16, 36864, 1536, "int8_channel", sms).fused is False  # past FUSED_M_MAX
    assert not any(small_m_config(m, 24576, 1536, "int8_block", sms).fused for m in (1, 4, 16, 64))
    assert small_m_config(1, 7168, 18432, "int8_channel", sms).split_k == 1  # 448 programs
    assert small_m_config(64, 36864, 7168, "int8_channel", sms).fused is False
    assert small_m_config(4, 1536, 7168, "int8_block", sms)[2] == 512
    assert small_m_config(4, 1536, 384, "int8_block", sms)[2] == 128  # the longest dividing K
    for m in (1, 4, 16, 64):
        for n, k in ((576, 7168), (1536, 7168), (24576, 1536), (7168, 18432), (36864, 7168)):
            for scheme in ("int8_channel", "int8_block"):
                cfg = small_m_config(m, n, k, scheme, sms)
                x_rows = min(1 << (m - 1).bit_length(), cfg.block_m) if cfg.fused else cfg.block_m
                stage = x_rows * cfg.block_k * (2 if cfg.fused else 1) + cfg.block_n * cfg.block_k
                shared = -(-n // cfg.block_n) * -(-m // cfg.block_m) * cfg.split_k > sms
                assert cfg.num_stages * stage <= (72 if shared else 160) * 1024
                assert cfg.block_n >= cfg.block_m // 2
                assert k % cfg.block_k == 0 or scheme == "int8_channel"
                k_split, splits = split_plan(k, cfg)
                assert k_split % cfg.block_k == 0 and (splits - 1) * k_split < k <= splits * k_split


@pytest.mark.parametrize("scheme,acc", CASES, ids=["channel-int32", "channel-fp32", "block"])
# 72 rows: two blocks of 64, the second partial (what 1000 rows, 16 blocks, exercised at several
# times the interpreter time); 128 fills its blocks, 1 and 7 fill part of one block of 16.
@pytest.mark.parametrize("m", [1, 7, 128, 72])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_split_k_against_float64(scheme, acc, m, fused):
    """Split-K (three K shares, the last one short; channel: K not a multiple of the K step) against
    the float64 reference, with a bias on odd batches; the int32 sum of the shares is the one-pass
    sum, so the channel int32 output equals the unsplit kernel's bit for bit."""
    gen = torch.Generator().manual_seed(100 + m)
    n = 40
    k = 1000 if scheme == "int8_channel" else 1024
    w, ws = _weights(n, k, scheme, gen)
    x = torch.randn(m, k, generator=gen)
    x[0, 7] = -11.0
    bias = torch.randn(n, generator=gen) if m % 2 else None
    bm = 16 if m <= 16 else 64
    cfg = SmallMConfig(bm, 16, 128, 4, 2, fused, 3)
    assert split_plan(k, cfg) == (384, 3)
    dev = [t if t is None else t.to(DEVICE) for t in (x, w, ws, bias)]
    out = dense_int8_small_m(*dev, scheme=scheme, accumulator=acc, config=cfg)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert _rel(out, _ref(x, w, ws, bias, scheme)) <= TIGHT
    if acc == "int32":
        one = dense_int8_small_m(*dev, scheme=scheme, accumulator=acc, config=cfg._replace(split_k=1))
        torch.testing.assert_close(out, one, rtol=0, atol=0)


def test_split_k_fp16_output_and_config_checks():
    """A split launch into fp16 (the reduction's one rounding), and the config's own checks."""
    cfg = SmallMConfig(16, 16, 256, 4, 2, True, 2)
    out, dev = _fp16_channel(9, 24, 768, 3, cfg)
    assert SmallMConfig.from_dict(cfg.to_dict()) == cfg
    # Programmatic dependent launch changes the launch only: off the GPU it runs as a plain one.
    pdl = cfg._replace(pdl=True)
    assert SmallMConfig.from_dict(pdl.to_dict()) == pdl and SmallMConfig.from_dict({**pdl.to_dict(), "pdl": 0}) == cfg
    out_pdl = dense_int8_small_m(*dev, scheme="int8_channel", accumulator="int32", config=pdl)
    assert torch.equal(out_pdl, out)
    # ... and so does its weight prefetch, which only a dependent launch has (bytes, >= 0).
    ahead = pdl._replace(prefetch=32768)
    assert SmallMConfig.from_dict(ahead.to_dict()) == ahead and SmallMConfig.from_dict(cfg.to_dict()).prefetch == 0
    assert torch.equal(dense_int8_small_m(*dev, scheme="int8_channel", accumulator="int32", config=ahead), out)
    with pytest.raises(ValueError, match="prefetch=4096, pdl=False"):
        SmallMConfig.from_dict({**cfg.to_dict(), "prefetch": 4096})
    with pytest.raises(ValueError, match="prefetch=-16"):
        SmallMConfig.from_dict({**ahead.to_dict(), "prefetch": -16})
    with pytest.raises(ValueError, match="split_k=0"):
        SmallMConfig.from_dict({**cfg.to_dict(), "split_k": 0})
    with pytest.raises(ValueError, match="block_n=24"):
        SmallMConfig.from_dict({**cfg.to_dict(), "block_n": 24})
    with pytest.raises(ValueError, match="unknown keys"):
        SmallMConfig.from_dict({**cfg.to_dict(), "BLOCK_M": 16})


_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from epmoe.kernels.common import next_pow2
from epmoe.kernels.dense_int8 import amax_unroll, dense_small_m_kernel as fn, small_m_config

for scheme, m, n, k, kw in (("int8_channel", 1, 576, 7168, {}), ("int8_channel", 16, 1536, 7168, {}),
                            ("int8_block", 2, 24576, 1536, dict(fused=True)), ("int8_channel", 64, 7168, 2048, {}),
                            ("int8_block", 4096, 7168, 2048, dict(fused=False, block_m=128, block_n=128))):
    cfg = small_m_config(m, n, k, scheme, 132, **kw)
    sig = {a: "i32" for a in fn.arg_names}
    split = cfg.split_k > 1
    out = ("*i32" if scheme == "int8_channel" else "*fp32") if split else "*bf16"
    sig.update(X="*bf16" if cfg.fused else "*i8", XS="*fp32", W="*i8", WS="*fp32", BIAS="*fp32", OUT=out,
               SA_OUT="*fp32")
    const = dict(FUSED=cfg.fused, BLOCK_SCALES=scheme == "int8_block", INT_ACC=scheme == "int8_channel",
                 HAS_BIAS=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True,
                 X_ROWS=min(next_pow2(m), cfg.block_m), QMAX=127.0, SCALE=128, SPLIT=split, GROUP_M=cfg.group_m,
                 AMAX_UNROLL=amax_unroll(cfg, m) if cfg.fused and scheme == "int8_channel" else 1, PDL=m <= 2,
                 PREFETCH=256 if m <= 2 else 0)
    sig.update({c: "constexpr" for c in const})
    # What the JIT infers for these shapes: 16-byte aligned pointers, strides and sizes divisible by 16.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in ("X", "XS", "W", "WS", "BIAS", "OUT", "N", "K", "stride_xm", "stride_wn", "stride_om")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in const.items()}, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=m <= 2))
    ptx = ck.asm["ptx"]
    assert ck.asm["cubin"]  # ptxas took the PTX (the prefetch's inline asm included)
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    prefetch = ptx.find("cp.async.bulk.prefetch.L2.global")
    # Where the grid dependency instructions sit: the prefetch before the wait; the trigger right
    # after the wait with a split (our reduction), else after the last MMA (the loop's end).
    order = ("none" if wait < 0 else "prefetch-wait-trigger-mma" if -1 < prefetch < wait < trigger < ptx.find("mma")
             else "prefetch-wait-mma-trigger" if -1 < prefetch < wait < ptx.rfind("mma") < trigger else "other")
    print(scheme, m, cfg.fused, ck.metadata.shared, ptx.count("cp.async"), ptx.count("mma"),
          ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"), int(ck.metadata.launch_pdl),
          ptx.count("cp.async.bulk.prefetch"), order)

from epmoe.kernels.dense_int8 import split_k_reduce_kernel as red
for scheme in ("int8_channel", "int8_block"):
    sig = {a: "i32" for a in red.arg_names}
    sig.update(P="*i32" if scheme == "int8_channel" else "*fp32", SA="*fp32", WS="*fp32", BIAS="*fp32", OUT="*bf16")
    pdl = scheme == "int8_channel"
    const = dict(BLOCK_SCALES=scheme == "int8_block", INT_ACC=scheme == "int8_channel", HAS_BIAS=True,
                 BLOCK_M=16, BLOCK_N=128, PDL=pdl)
    sig.update({c: "constexpr" for c in const})
    src = ASTSource(red, sig, constexprs={(red.arg_names.index(c),): v for c, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=pdl))
    ptx = ck.asm["ptx"]
    assert (ptx.count("griddepcontrol.wait") > 0, ptx.count("griddepcontrol.launch_dependents") > 0) == (pdl, pdl), scheme
print("reduce ok")
"""


def test_small_m_kernel_compiles_for_sm90():
    """The kernel compiles for an H100/H200 (sm_90, the triton wheel's ptxas; no GPU needed) with
    its weight loads pipelined through shared memory (cp.async): a fused split-K config (kv_a at
    one row), an unfused one, the block scheme, an unfused split at 64 rows, 128-row tiles in
    groups of 8 row tiles (block scheme, 4096 rows); and the split-K reduction for both schemes.
    The first two and a reduction are also compiled as programmatic dependent launches
    (SmallMConfig.pdl, with a weight prefetch): their PTX prefetches into L2, then waits on the grid
    dependency, and the GEMM triggers its dependents (right after the wait with a split, after
    its K loop without); the others have no such instruction.
    The interpreter runs the Python, not this lowering."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("the triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")[:5]
    assert [ln.split()[:3] for ln in lines] == [["int8_channel", "1", "True"], ["int8_channel", "16", "False"],
                                                ["int8_block", "2", "True"], ["int8_channel", "64", "False"],
                                                ["int8_block", "4096", "False"]]  # fmt: skip
    assert done.stdout.split("\n")[5] == "reduce ok"
    orders = ["prefetch-wait-trigger-mma", "none", "prefetch-wait-mma-trigger", "none", "none"]
    for i, ln in enumerate(lines):
        shared, cp_async, mma, wait, trigger, pdl, prefetch = map(int, ln.split()[3:-1])
        assert cp_async > 0 and mma > 0 and shared <= 227 * 1024
        assert (wait > 0, trigger > 0, pdl, prefetch > 0) == ((True, True, 1, True) if i < 3 and i != 1
                                                              else (False, False, 0, False))
        assert ln.split()[-1] == orders[i], ln


def test_checked_launch_unfuses_tall_tiles_on_unaligned_rows():
    """The fused 64-row kernel runs only on 16-byte aligned activation and weight rows (Triton's
    fence placement, docs/dense.md); otherwise the same launch unfused. Short tiles and aligned
    rows keep theirs."""
    from epmoe.kernels.dense_int8 import checked_launch

    tall = SmallMConfig(64, 128, 128, 4, 2, True)
    w_ok, w_odd = torch.zeros(8, 1024, dtype=torch.int8), torch.zeros(8, 1000, dtype=torch.int8)
    x_ok = torch.zeros(3, 1024, dtype=torch.bfloat16)
    assert checked_launch(tall, x_ok, w_ok) == tall
    assert checked_launch(tall, torch.zeros(3, 1000, dtype=torch.bfloat16), w_odd) == tall._replace(fused=False)
    assert checked_launch(tall, torch.zeros(3, 1032, dtype=torch.bfloat16)[:, 1:1025], w_ok).fused is False  # 2-byte offset
    assert checked_launch(tall._replace(block_m=32), torch.zeros(3, 1000, dtype=torch.bfloat16), w_odd).fused is True
    assert checked_launch(tall._replace(fused=False), x_ok, w_odd).fused is False


@pytest.mark.parametrize("group_m", [1, 3])
def test_tile_order_covers_every_tile(group_m):
    """Many row tiles in groups of ``group_m`` (the last group short: 16 row tiles in groups of 3),
    split K, and N not a multiple of the tile: every output element against float64, and the
    int32 result equals the one-group order's bit for bit."""
    gen = torch.Generator().manual_seed(11)
    m, n, k = 1000, 40, 256
    w, ws = _weights(n, k, "int8_channel", gen)
    x = torch.randn(m, k, generator=gen)
    cfg = SmallMConfig(64, 16, 128, 4, 2, False, 2, group_m)
    dev = [t.to(DEVICE) for t in (x, w, ws)]
    out = dense_int8_small_m(*dev, scheme="int8_channel", accumulator="int32", config=cfg)
    assert _rel(out, _ref(x, w, ws, None, "int8_channel")) <= TIGHT
    plain = dense_int8_small_m(*dev, scheme="int8_channel", accumulator="int32", config=cfg._replace(group_m=1))
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
