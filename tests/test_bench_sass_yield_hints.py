"""benchmarks/sass_yield_hints.py without a GPU or cuobjdump: the disassembly it reads, the bits it
changes (and only those), and its refusals."""

from __future__ import annotations

import struct

import pytest

from benchmarks import sass_yield_hints as syh

# The sm_90 control bits in an instruction's high word, written out (not the module's constants):
# yield at bit 45 (set: no yield), operand reuse at bits 58-61.
YIELD = 0x0000200000000000
BASE = 0x000FC20000000000  # stall and barrier bits, bit 45 clear
NO_YIELD = BASE | YIELD | 0x2400000000000000  # no yield, the first and last reuse bits (58, 61)
KERNEL = "_ZN7cutlass13device_kernelIN5epmoe23Sm90BlockScaledMainloopIiEEEEvv"  # an INT8 block kernel's name, shortened


def _listing(name: str, rows: list[tuple[str, int, int]]) -> str:
    """cuobjdump -sass text of one function: each instruction's line with its low word, then a line
    with its high word."""
    out = ["Fatbin elf code:", "================", "arch = sm_90a", "\tcode for sm_90a", f"\t\tFunction : {name}",
           '\t.headerflags\t@"EF_CUDA_SM90"']
    for i, (text, low, high) in enumerate(rows):
        out.append(f"        /*{16 * i:04x}*/                   {text} ;          /* 0x{low:016x} */")
        out.append(f"                                                      /* 0x{high:016x} */")
    return "\n".join(out) + "\n"


ROWS = [
    ("I2FP.F32.S32 R1, R2", 0x0000000200017245, NO_YIELD),
    ("FFMA R3, R1, R4.reuse, R3", 0x0000000401037223, NO_YIELD),
    ("FFMA R5, R6, R4, R5", 0x0000000406057223, NO_YIELD),
    ("@P0 FFMA R7, R8, R4, R7", 0x0000000408070223, NO_YIELD),
    ("FFMA.FTZ R9, R8, R4, R9", 0x0000000408090223, NO_YIELD),
    ("IGMMA.64x64x32.S8.S8 R24, gdesc[UR4], R24", 0x00000004181879F0, NO_YIELD),
]


def _code(rows) -> bytes:
    return b"".join(struct.pack("<QQ", low, high) for _, low, high in rows)


def test_parse_reads_every_instruction_with_both_words_per_cubin():
    functions = syh.parse_sass(_listing("kern", ROWS) + _listing("other", ROWS[1:3]) + _listing("kern", ROWS[:2]))
    assert list(functions) == [(1, "kern"), (2, "other"), (3, "kern")]  # one name in two cubins: two functions
    assert len(functions[(3, "kern")]) == 2
    kern = functions[(1, "kern")]
    assert [i.address for i in kern] == [0, 16, 32, 48, 64, 80]
    assert [i.mnemonic for i in kern] == ["I2FP.F32.S32", "FFMA", "FFMA", "FFMA", "FFMA.FTZ", "IGMMA.64x64x32.S8.S8"]
    assert kern[1].low == ROWS[1][1] and kern[1].high == NO_YIELD
    assert kern[1].encoded() == _code(ROWS[1:2])


@pytest.mark.parametrize("every, chosen", [(1, [1, 2, 3]), (2, [1, 3]), (3, [1])])
def test_every_nth_plain_ffma_yields_with_its_reuse_cleared(every, chosen):
    edits = syh.yield_edits(syh.parse_sass(_listing("kern", ROWS))[(1, "kern")], every)
    assert sorted(edits) == chosen  # FFMA.FTZ (4) and the other opcodes are never touched
    for high in edits.values():
        assert high == BASE  # yield (bit 45 clear), no reuse, every other bit kept


def test_an_ffma_that_yields_already_is_left_alone():
    rows = [ROWS[0], ("FFMA R3, R1, R4, R3", 0x0000000401037223, NO_YIELD & ~YIELD)]
    assert syh.yield_edits(syh.parse_sass(_listing("kern", rows))[(1, "kern")], 1) == {}


def test_patch_rewrites_the_int8_block_kernels_only_in_every_copy():
    channel = "_ZN7cutlass13device_kernelINS_10collective13CollectiveMmaIiEEEEvv"  # converts int32 sums too
    data = bytearray(b"head" + _code(ROWS) + b"mid" + _code(ROWS) + b"x" + _code(ROWS[1:3]) + b"tail")
    before = bytes(data)
    functions = syh.parse_sass(_listing(KERNEL, ROWS) + _listing(KERNEL + "fp8", ROWS[1:3]) + _listing(channel, ROWS))
    changed = syh.patch(data, functions, every=2)
    assert changed == {KERNEL: 4}  # two FFMAs in each of two copies; no I2FP.F32.S32 in fp8, not the mainloop's in channel
    assert len(data) == len(before)
    diff = [i for i in range(len(data)) if data[i] != before[i]]
    starts = [4, 4 + len(_code(ROWS)) + 3]
    # only the high words of instructions 1 and 3 of each copy, bytes 8..15
    assert diff and all(any(s + 16 * j + 8 <= i < s + 16 * j + 16 for s in starts for j in (1, 3)) for i in diff)
    assert bytes(data[-len(_code(ROWS[1:3])) - 4:-4]) == _code(ROWS[1:3])


def test_patch_refuses_code_it_cannot_find():
    with pytest.raises(ValueError, match="not in the file as disassembled"):
        syh.patch(bytearray(b"nothing here"), syh.parse_sass(_listing(KERNEL, ROWS)), 2)


def test_patch_refuses_a_listing_with_gaps():
    listing = _listing(KERNEL, ROWS).replace("/*0010*/", "/*0020*/", 1)
    with pytest.raises(ValueError, match="not one contiguous instruction stream"):
        syh.patch(bytearray(_code(ROWS)), syh.parse_sass(listing), 2)


def test_arguments_are_refused_by_name(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        syh.parse_args([str(tmp_path / "none.so")])
    assert "no such file" in capsys.readouterr().err
    lib = tmp_path / "x.so"
    lib.write_bytes(b"")
    with pytest.raises(SystemExit):
        syh.parse_args([str(lib), "--every", "0"])
    assert "--every must be >= 1; got 0" in capsys.readouterr().err
    monkeypatch.setenv("EPMOE_CACHE_DIR", str(tmp_path))  # the package's cache: never rewritten in place
    with pytest.raises(SystemExit):
        syh.parse_args([str(lib)])
    assert "is inside the cache the package loads from" in capsys.readouterr().err
