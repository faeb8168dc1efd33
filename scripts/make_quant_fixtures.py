#!/usr/bin/env python3
"""Writes the dequantization oracle fixtures: for every ggml type Strata decodes, random VALID
blocks and the `gguf` Python package's (gguf-py's) `dequantize` of them, into
schemas/tests/data/quants/<type>.bin (the raw blocks) and <type>.f32 (1024 little-endian f32
values). schemas/tests/quant_fixtures.rs checks that Strata's CPU reference decodes every
.bin to exactly the .f32 (bit for bit).

Blocks are random bytes (so every quant, grid index and sign bit pattern is exercised: each
i-quant index field is as wide as its table, so any bytes are a valid index) with every float
scale field overwritten by a finite f16 (or, for MXFP4, an e8m0 exponent that keeps values
finite). The bytes come from a splitmix64 stream seeded by the type name, so they do not
depend on numpy's generators; the values come from gguf-py.

    pip install gguf numpy
    python3 scripts/make_quant_fixtures.py          # rewrite the fixtures
    python3 scripts/make_quant_fixtures.py --check  # exit 1 unless gguf-py reproduces them (CI)
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "schemas/tests/data/quants"
N_VALUES = 1024

# type -> byte offsets of its f16 scale fields (None: a special layout handled below)
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0],
    T.IQ1_S: [0], T.IQ1_M: None, T.IQ4_NL: [0], T.IQ4_XS: [0], T.MXFP4: None,
    T.F32: None, T.F16: None, T.BF16: None,
}

MASK = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed):
        self.s = seed & MASK

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def bytes(self, n):
        out = bytearray()
        while len(out) < n:
            out += self.next().to_bytes(8, "little")
        return bytes(out[:n])

    def unit(self):
        return (self.next() >> 11) / float(1 << 53)


def fnv1a(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def finite_f16(rng, lo=-10.0, hi=0.0, signed=True):
    """A finite f16 of magnitude 2^U(lo, hi), random sign."""
    mag = 2.0 ** (lo + (hi - lo) * rng.unit())
    if signed and rng.next() & 1:
        mag = -mag
    return np.array([mag], dtype=np.float16).view(np.uint8).tobytes()


def plain_values(ty, rng):
    """Random finite values of a plain type, as raw bytes."""
    if ty == T.F32:
        v = np.array([(rng.unit() - 0.5) * 2.0 ** (16 * rng.unit() - 8) for _ in range(N_VALUES)], dtype=np.float32)
        return v.tobytes()
    bits = np.frombuffer(rng.bytes(2 * N_VALUES), dtype=np.uint16).copy()
    # Clear one exponent bit so no value is Inf or NaN (exponent never all ones).
    if ty == T.F16:
        bits &= np.uint16(0xBFFF)
    else:  # BF16
        bits &= np.uint16(0xBFFF)
    return bits.tobytes()


def blocks(ty):
    rng = SplitMix64(fnv1a(ty.name))
    if ty in (T.F32, T.F16, T.BF16):
        return plain_values(ty, rng)
    elems, size = GGML_QUANT_SIZES[ty]
    out = bytearray()
    for _ in range(N_VALUES // elems):
        b = bytearray(rng.bytes(size))
        if ty == T.IQ1_M:
            d = int.from_bytes(finite_f16(rng), "little")
            for i in range(4):
                at = 48 + 2 * i
                w = int.from_bytes(b[at:at + 2], "little") & 0x0FFF
                w |= ((d >> (4 * i)) & 0xF) << 12
                b[at:at + 2] = w.to_bytes(2, "little")
        elif ty == T.MXFP4:
            b[0] = 100 + rng.next() % 50
        else:
            for off in F16_FIELDS[ty]:
                b[off:off + 2] = finite_f16(rng)
        out += b
    return bytes(out)


def fixture(ty):
    raw = blocks(ty)
    data = np.frombuffer(raw, dtype=np.uint8)
    if ty == T.BF16:
        from gguf.quants import BF16
        vals = BF16.dequantize(data.reshape(1, -1))
    else:
        vals = dequantize(data.reshape(1, -1), ty)
    vals = np.asarray(vals, dtype=np.float32).reshape(-1)
    assert vals.size == N_VALUES, (ty.name, vals.size)
    assert np.all(np.isfinite(vals)), ty.name
    return raw, vals.astype("<f4").tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures instead of writing")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    bad = []
    for ty in F16_FIELDS:
        raw, vals = fixture(ty)
        stem = ty.name.lower()
        for suffix, content in ((".bin", raw), (".f32", vals)):
            path = OUT / (stem + suffix)
            if args.check:
                if not path.exists() or path.read_bytes() != content:
                    bad.append(path.relative_to(ROOT))
            else:
                path.write_bytes(content)
    if args.check:
        if bad:
            for p in bad:
                print(f"{p}: not reproduced by this gguf-py; rerun scripts/make_quant_fixtures.py and review", file=sys.stderr)
            sys.exit(1)
        print(f"quant fixtures: {len(F16_FIELDS)} types reproduced by gguf-py")
    else:
        print(f"wrote {2 * len(F16_FIELDS)} files under {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
