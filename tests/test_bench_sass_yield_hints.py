"""benchmarks/sass_yield_hints.py without a GPU or cuobjdump: the disassembly it reads, the bits it
changes (and only those), and its refusals."""

from __future__ import annotations

import struct

import pytest

from benchmarks import sass_yield_hints as syh

NO_YIELD = syh.YIELD_BIT | (0x1 << 58) | 0x000FE20000000000  # stall bits and a reuse flag set, no yield


def _listing(name: str, rows: list[tuple[str, int, int]]) -> str:
    """cuobjdump -sass text of one function: each instruction's line with its low word, then a line
    with its high word."""
    out = ["\tcode for sm_90a", f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
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


def test_parse_reads_every_instruction_with_both_words():
    functions = syh.parse_sass(_listing("kern", ROWS) + _listing("other", ROWS[1:3]))
    assert list(functions) == ["kern", "other"]
    kern = functions["kern"]
    assert [i.address for i in kern] == [0, 16, 32, 48, 64, 80]
    assert [i.mnemonic for i in kern] == ["I2FP.F32.S32", "FFMA", "FFMA", "FFMA", "FFMA.FTZ", "IGMMA.64x64x32.S8.S8"]
    assert kern[1].low == ROWS[1][1] and kern[1].high == NO_YIELD
    assert kern[1].encoded() == _code(ROWS[1:2])


@pytest.mark.parametrize("every, chosen", [(1, [1, 2, 3]), (2, [1, 3]), (3, [1])])
def test_every_nth_plain_ffma_yields_with_its_reuse_cleared(every, chosen):
    edits = syh.yield_edits(syh.parse_sass(_listing("kern", ROWS))["kern"], every)
    assert sorted(edits) == chosen  # FFMA.FTZ (4) and the other opcodes are never touched
    for high in edits.values():
        assert high & syh.YIELD_BIT == 0 and high & syh.REUSE_BITS == 0
        assert high | syh.YIELD_BIT | (0x1 << 58) == NO_YIELD  # no other bit changed


def test_an_ffma_that_yields_already_is_left_alone():
    rows = [ROWS[0], ("FFMA R3, R1, R4, R3", 0x0000000401037223, NO_YIELD & ~syh.YIELD_BIT)]
    assert syh.yield_edits(syh.parse_sass(_listing("kern", rows))["kern"], 1) == {}


def test_patch_rewrites_the_int8_kernels_only_in_every_copy():
    data = bytearray(b"head" + _code(ROWS) + b"mid" + _code(ROWS) + b"x" + _code(ROWS[1:3]) + b"tail")
    before = bytes(data)
    functions = syh.parse_sass(_listing("int8", ROWS) + _listing("fp8", ROWS[1:3]))
    changed = syh.patch(data, functions, every=2)
    assert changed == {"int8": 4}  # two FFMAs in each of two copies; fp8 has no I2FP.F32.S32
    assert len(data) == len(before)
    diff = [i for i in range(len(data)) if data[i] != before[i]]
    starts = [4, 4 + len(_code(ROWS)) + 3]
    # only the high words of instructions 1 and 3 of each copy, bytes 8..15
    assert diff and all(any(s + 16 * j + 8 <= i < s + 16 * j + 16 for s in starts for j in (1, 3)) for i in diff)
    assert bytes(data[-len(_code(ROWS[1:3])) - 4:-4]) == _code(ROWS[1:3])


def test_patch_refuses_code_it_cannot_find():
    with pytest.raises(ValueError, match="not in the file as disassembled"):
        syh.patch(bytearray(b"nothing here"), syh.parse_sass(_listing("int8", ROWS)), 2)


def test_arguments_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        syh.parse_args([str(tmp_path / "none.so")])
    assert "no such file" in capsys.readouterr().err
    lib = tmp_path / "x.so"
    lib.write_bytes(b"")
    with pytest.raises(SystemExit):
        syh.parse_args([str(lib), "--every", "0"])
    assert "--every must be >= 1; got 0" in capsys.readouterr().err
