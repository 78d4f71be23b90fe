"""Study: the scheduler's yield hint on the INT8 block kernels' promotion FFMAs, set by rewriting
the SASS of a built extension library in place (a copy: never the cached one a user loads).

In the profile of the fused GEMM1 (``int8_block_profile.py``) the consumer warps spend their issue
slots on the promotion (I2FP and FFMA, 60 % of the instructions) and the tensor pipe idles a third
of the time; DeepGEMM once raised its FP8 kernels' overlap of MMAs and promotion FFMAs by setting
the yield bit on part of those FFMAs (and clearing their operand-reuse bits, which a yield
invalidates). This sets it on every ``--every``-th plain FFMA of the INT8 block kernels (the
block-scaled mainloop's kernels that convert int32 sums, ``I2FP.F32.S32``; in them nearly every
plain FFMA is the promotion's), so that timing the copy beside the original says whether ptxas's
schedule leaves that to gain. Run it with ``EPMOE_CACHE_DIR`` unset: it refuses to rewrite a
library inside the cache the package loads from::

    cp -r ~/.cache/epmoe /tmp/cache_y2
    python benchmarks/sass_yield_hints.py /tmp/cache_y2/cutlass/<build>/<build>.so --every 2
    EPMOE_CACHE_DIR=/tmp/cache_y2 python benchmarks/int8_block_gemms.py --out y2.json

Needs ``cuobjdump`` (the CUDA toolkit) to disassemble; the bits are those of the sm_90 encoding
(a 128-bit instruction, the control bits in the high 64: yield at bit 45, cleared to yield; the
four operand-reuse bits at 58-61).
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # epmoe of this checkout

YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_LOW = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_CUBIN = re.compile(r"^\s*Fatbin elf code:")


def sass_mnemonic(text: str) -> str:
    """``FFMA.FTZ`` of ``@P0 FFMA.FTZ R1, ...``: a SASS instruction's opcode with its modifiers."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    low: int
    high: int

    @property
    def mnemonic(self) -> str:
        return sass_mnemonic(self.text)

    def encoded(self, high: int | None = None) -> bytes:
        return struct.pack("<QQ", self.low, self.high if high is None else high)


def parse_sass(text: str) -> dict[tuple[int, str], list[Instruction]]:
    """``{(cubin, function): instructions}`` of ``cuobjdump -sass`` output: ``cubin`` counts the
    ELF images in listing order (a function of the same name may be in several), and each
    instruction is a line with its address, text and low word, then a line with its high word."""
    functions: dict[tuple[int, str], list[Instruction]] = {}
    current = None
    cubin = 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FUNCTION.match(lines[i])
        if _CUBIN.match(lines[i]):
            cubin += 1
            current = None
        elif m:
            current = functions.setdefault((cubin, m.group(1)), [])
        else:
            low = _LOW.search(lines[i])
            high = _HIGH.match(lines[i + 1]) if low and i + 1 < len(lines) else None
            if low and high and current is not None:
                current.append(Instruction(int(low.group(1), 16), low.group(2), int(low.group(3), 16),
                                           int(high.group(1), 16)))  # fmt: skip
                i += 2
                continue
        i += 1
    return functions


def is_int8_block_kernel(name: str, instructions: list[Instruction]) -> bool:
    """The INT8 block kernels: the block-scaled mainloop's (``Sm90BlockScaledMainloop`` in the
    mangled name; FP8's too) that convert int32 sums (INT8's only)."""
    return "Sm90BlockScaledMainloop" in name and any(ins.mnemonic == "I2FP.F32.S32" for ins in instructions)


def yield_edits(instructions: list[Instruction], every: int) -> dict[int, int]:
    """``{index: new high word}``: every ``every``-th plain FFMA (the promotion's; not ``FFMA.FTZ``
    and the like) that does not yield yet, made to yield with its reuse bits cleared."""
    ffma = [j for j, ins in enumerate(instructions) if ins.mnemonic == "FFMA"]
    return {j: (instructions[j].high & ~YIELD_BIT) & ~REUSE_BITS
            for n, j in enumerate(ffma) if n % every == 0 and instructions[j].high & YIELD_BIT}  # fmt: skip


def patch(data: bytearray, functions: dict[tuple[int, str], list[Instruction]], every: int) -> dict[str, int]:
    """Sets the yield hints (:func:`yield_edits`) in ``data`` (a library or object holding the
    functions' code uncompressed) for the INT8 block kernels (:func:`is_int8_block_kernel`);
    ``{function: instructions changed}`` (counting each copy of its code found in ``data``).

    Raises:
        ValueError: a function's code is not in ``data`` byte for byte (a compressed fatbin), or
            its listing is not one contiguous instruction stream.
    """
    changed: dict[str, int] = {}
    for (_, name), instructions in functions.items():
        if not is_int8_block_kernel(name, instructions):
            continue
        if [ins.address for ins in instructions] != [16 * j for j in range(len(instructions))]:
            raise ValueError(f"{name}: the disassembly is not one contiguous instruction stream")
        code = b"".join(ins.encoded() for ins in instructions)
        starts = [m.start() for m in re.finditer(re.escape(code[:256]), data) if data[m.start():m.start() + len(code)] == code]
        if not starts:
            raise ValueError(f"{name}: its code is not in the file as disassembled (a compressed fatbin?)")
        edits = yield_edits(instructions, every)
        for start in starts:
            for j, high in edits.items():
                data[start + 16 * j:start + 16 * j + 16] = instructions[j].encoded(high)
        changed[name] = changed.get(name, 0) + len(edits) * len(starts)
    return changed


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/sass_yield_hints.py", description=__doc__.split("\n\n")[0])
    p.add_argument("library", help="a copy of the built extension library (.so) to rewrite in place")
    p.add_argument("--every", type=int, default=2, help="every N-th FFMA of a kernel yields (default: %(default)s)")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error(f"--every must be >= 1; got {args.every}")
    library = Path(args.library)
    if not library.is_file():
        p.error(f"library={args.library!r}: no such file")
    from epmoe.experts.cutlass_backend import cache_dir

    if cache_dir().resolve() in library.resolve().parents:
        p.error(f"library={args.library!r} is inside the cache the package loads from ({cache_dir()}); "
                "rewrite a copy (cp -r the cache elsewhere, EPMOE_CACHE_DIR unset here)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tool = shutil.which("cuobjdump")
    if tool is None:
        print("benchmarks/sass_yield_hints.py needs cuobjdump (the CUDA toolkit) on PATH", file=sys.stderr)
        return 2
    listing = subprocess.run([tool, "-sass", args.library], capture_output=True, text=True)
    if listing.returncode != 0:
        print(f"library={args.library!r}: cuobjdump -sass failed: {listing.stderr.strip()}", file=sys.stderr)
        return 2
    data = bytearray(Path(args.library).read_bytes())
    try:
        changed = patch(data, parse_sass(listing.stdout), args.every)
    except ValueError as exc:
        print(f"library={args.library!r}: {exc}", file=sys.stderr)
        return 2
    if not sum(changed.values()):
        print(f"library={args.library!r}: no INT8 block kernel FFMA to change; the file is left as it was", file=sys.stderr)
        return 1
    Path(args.library).write_bytes(bytes(data))
    for name, n in changed.items():
        print(f"{n:5d} FFMA yield in {name[:100]}")
    print(f"{sum(changed.values())} instructions changed in {len(changed)} kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
