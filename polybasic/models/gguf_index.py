"""The tensors of a GGUF file, read without building its metadata.

gguf's GGUFReader turns every metadata value into numpy views, the tokenizer's ~100k vocabulary and
merge strings included: 2-3 s for SmolLM2's file before the first tensor. The tensors are all a
compiled step's start-up needs, so this walks the header and skips the values (GGUF v2/v3 layout:
magic, version, tensor and key-value counts; key-value pairs; tensor infos; aligned data).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> byte size, for the fixed-size GGUF value types (8 = string, 9 = array)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = "general.alignment"


@dataclass
class TensorInfo:
    name: str
    kind: str  # GGMLQuantizationType name, e.g. "Q4_K", "F32"
    shape: tuple[int, ...]  # GGUF order: the contiguous dimension first
    data: np.ndarray  # the tensor's raw bytes, uint8, a view of the memory-mapped file
    block_bytes: int  # bytes per block of its type (GGML_QUANT_SIZES)


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.take("Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            n = self.take("Q")  # read before adding: take moves pos
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.take("IQ")
            if etype in _FIXED:
                self.pos += _FIXED[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"GGUF value type {vtype} is unknown")


def read_tensor_infos(path: str | Path) -> list[TensorInfo]:
    """Every tensor of a GGUF file, in file order, its data memory-mapped (nothing is copied)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # constants only (start-up time)

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    magic, version, n_tensors, n_kv = cur.take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF v2+ file (magic {magic!r}, version {version})")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        if key == _ALIGNMENT_KEY and vtype == 4:
            alignment = cur.take("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        kind, offset = GGMLQuantizationType(cur.take("I")), cur.take("Q")
        infos.append((name, kind, dims, offset))
    start = -(-cur.pos // alignment) * alignment
    out = []
    for name, kind, dims, offset in infos:
        block, nbytes = GGML_QUANT_SIZES[kind]
        size = int(np.prod(dims)) // block * nbytes
        out.append(TensorInfo(name, kind.name, dims, buf[start + offset:start + offset + size], nbytes))
    return out
