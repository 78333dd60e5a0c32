"""A GGUF reader for what the loader uses: metadata values and tensor views of the mmap.

gguf.GGUFReader builds a numpy view for every part of every metadata field, which for a
tokenizer's ~100k vocabulary and merge strings costs 10-25 s per process on a small CPU; this
parses the same header with struct in well under a second. Same interface as the subset of
GGUFReader engine/loader/gguf.py reads: `fields[key].contents()`, `tensors[i].name / .shape
(ne0 first) / .tensor_type / .data` (GGUFReader's dtype and shape for each type).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF" little-endian
_SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
           GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
           GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
           GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims, ne0 first (as GGUF stores them)
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            sub, n = GGUFValueType(self.take("I")), self.take("Q")
            if sub in _SCALAR:  # numeric arrays in one unpack
                fmt = f"<{n}{_SCALAR[sub]}"
                out = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return out
            return [self.value(sub) for _ in range(n)]
        return self.take(_SCALAR[vtype])


class GGUFFile:
    """Raises ValueError (bad magic, version, type or truncation) like GGUFReader."""

    def __init__(self, path: str):
        self.mmap = np.memmap(path, mode="r")
        cur = _Cursor(memoryview(self.mmap))
        try:
            if cur.take("I") != _MAGIC:
                raise ValueError("GGUF magic invalid")
            version = cur.take("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} unsupported")
            n_tensors, n_kv = cur.take("Q"), cur.take("Q")
            self.fields: dict[str, Field] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.fields[key] = Field(cur.value(cur.take("I")))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.take("Q") for _ in range(cur.take("I"))]
                infos.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
        except struct.error as e:
            raise ValueError(f"truncated header: {e}") from None
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor name")

    def _tensor(self, start: int, name: str, dims: list[int], qtype: GGMLQuantizationType,
                offset: int) -> Tensor:
        n = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        off = start + offset
        if qtype in _PLAIN:
            dt, count = np.dtype(_PLAIN[qtype]), n
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            dt, count = np.dtype(np.uint8), n * size // block
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        if off + count * dt.itemsize > len(self.mmap):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.ndarray((count,), dtype=dt, buffer=self.mmap, offset=off).reshape(np_dims)
        return Tensor(name, qtype, np.array(dims, dtype=np.uint64), data)
