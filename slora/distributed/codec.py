"""A step's message from rank 0 to the workers, as one int64 tensor.

`encode(value)` flattens a tree of the types a step's batch is made of (None, bool, int,
float, str, tensors, lists, tuples, dicts with str keys, and the dataclasses of `CLASSES`)
into int64 words; `decode` rebuilds it. Tensors travel as their raw bytes with dtype and
shape; a tensor met twice (Batch.q_start_tensor is LoraMeta.seg_start) travels once and
comes back as one tensor. Nothing is pickled: a worker reads words, never runs code from
the message.
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from slora.kernels import DecodeSegments, GroupMeta, LoraMeta
from slora.model.llama import Batch

CLASSES = (Batch, LoraMeta, GroupMeta, DecodeSegments)  # the dataclasses a message may hold
DTYPES = (torch.int64, torch.int32, torch.float32, torch.float16, torch.bfloat16, torch.uint8,
          torch.bool, torch.int16, torch.int8, torch.float64)
NONE, FALSE, TRUE, INT, FLOAT, STR, TENSOR, SAME, LIST, TUPLE, DICT, OBJ = range(12)


def encode(value) -> torch.Tensor:
    """`value` as one int64 tensor (see the module docstring)."""
    words: list = []
    _put(value, words, {})
    parts, ints = [], []
    for w in words:
        if isinstance(w, torch.Tensor):
            if ints:
                parts.append(torch.tensor(ints, dtype=torch.int64))
                ints = []
            parts.append(w)
        else:
            ints.append(w)
    if ints or not parts:
        parts.append(torch.tensor(ints, dtype=torch.int64))
    return torch.cat(parts)


def _put(v, out: list, seen: dict) -> None:
    if v is None:
        out.append(NONE)
    elif isinstance(v, bool):
        out.append(TRUE if v else FALSE)
    elif isinstance(v, int):
        out += [INT, v]
    elif isinstance(v, float):
        out += [FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]]
    elif isinstance(v, str):
        _put_bytes(v.encode(), STR, out)
    elif isinstance(v, torch.Tensor):
        if id(v) in seen:
            out += [SAME, seen[id(v)]]
            return
        seen[id(v)] = len(seen)
        t = v.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out += [TENSOR, DTYPES.index(t.dtype), t.dim(), *t.shape]
        _put_bytes(raw, None, out)
    elif isinstance(v, (list, tuple)):
        out += [LIST if isinstance(v, list) else TUPLE, len(v)]
        for x in v:
            _put(x, out, seen)
    elif isinstance(v, dict):
        out += [DICT, len(v)]
        for k, x in v.items():
            _put(str(k), out, seen)
            _put(x, out, seen)
    elif type(v) in CLASSES:
        out += [OBJ, CLASSES.index(type(v))]
        for f in dataclasses.fields(v):
            _put(getattr(v, f.name), out, seen)
    else:
        raise TypeError(f"a tensor-parallel step message cannot carry {type(v).__name__} "
                        f"({v!r:.80}); add its dataclass to slora.distributed.codec.CLASSES")


def _put_bytes(raw, tag: int | None, out: list) -> None:
    """Length, then the bytes padded to whole int64 words."""
    n = len(raw)
    if tag is not None:
        out.append(tag)
    out.append(n)
    if isinstance(raw, bytes):
        raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else \
            torch.empty(0, dtype=torch.uint8)
    pad = -n % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    out.append(raw.view(torch.int64))


def decode(msg: torch.Tensor):
    """The value `encode` flattened into `msg`."""
    return _Reader(msg.contiguous()).get()


class _Reader:
    def __init__(self, msg: torch.Tensor) -> None:
        self.msg, self.words, self.at, self.tensors = msg, msg.tolist(), 0, []

    def word(self) -> int:
        self.at += 1
        return self.words[self.at - 1]

    def raw(self) -> torch.Tensor:
        n = self.word()
        w = -(-n // 8)
        out = self.msg[self.at:self.at + w].view(torch.uint8)[:n]
        self.at += w
        return out

    def get(self):
        tag = self.word()
        if tag == NONE:
            return None
        if tag in (FALSE, TRUE):
            return tag == TRUE
        if tag == INT:
            return self.word()
        if tag == FLOAT:
            return struct.unpack("<d", struct.pack("<q", self.word()))[0]
        if tag == STR:
            return bytes(self.raw().tolist()).decode()
        if tag == TENSOR:
            dtype, ndim = DTYPES[self.word()], self.word()
            shape = [self.word() for _ in range(ndim)]
            t = self.raw().clone().view(dtype).view(shape)
            self.tensors.append(t)
            return t
        if tag == SAME:
            return self.tensors[self.word()]
        if tag in (LIST, TUPLE):
            items = [self.get() for _ in range(self.word())]
            return items if tag == LIST else tuple(items)
        if tag == DICT:
            n = self.word()
            return {self.get(): self.get() for _ in range(n)}
        if tag == OBJ:
            cls = CLASSES[self.word()]
            return cls(**{f.name: self.get() for f in dataclasses.fields(cls)})
        raise ValueError(f"tensor-parallel step message: unknown tag {tag} at word {self.at - 1}")
