"""The one codec for every message that crosses a process (ZMQ sockets, process pools).

Messages are dataclasses pickled with protocol 5; tensors are turned into numpy arrays so their data travels
as out-of-band ZMQ frames (no pickled copy of the bytes), except small ones (INBAND_MAX_BYTES), copied into
the pickle.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import numpy as np
import torch
import zmq


# A tensor up to this size travels inside the pickle: a ZMQ frame of its own costs more than copying it
# (a step's 64 embedding vectors of 1 KiB each were 64 frames: ~45 us each to send on a CPU, again to receive).
INBAND_MAX_BYTES = 4096


def _reduce_tensor(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
        return _tensor_from_bf16_bits, (t.view(torch.int16).numpy(),)
    a = t.numpy()
    if a.nbytes <= INBAND_MAX_BYTES:
        return _tensor_from_bytes, (a.tobytes(), a.dtype.str, a.shape)
    return torch.from_numpy, (a,)


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=dtype).reshape(shape))  # bytearray: writable


def _tensor_from_bf16_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce_tensor


def encode(obj: Any) -> list:
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [f.getvalue(), *buffers]


def decode(frames: list) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def dumps(obj: Any) -> bytes:
    """`encode` as one in-band blob, for channels that carry a single bytes object (process pools)."""
    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(obj)
    return f.getvalue()


def loads(blob: bytes) -> Any:
    return pickle.loads(blob)


def send(sock: zmq.Socket, obj: Any, flags: int = 0) -> None:
    sock.send_multipart(encode(obj), flags=flags, copy=False)


def recv(sock: zmq.Socket, flags: int = 0) -> Any:
    frames = sock.recv_multipart(flags=flags, copy=False)
    return decode([f.buffer for f in frames])


async def recv_async(sock) -> Any:
    frames = await sock.recv_multipart(copy=False)
    return decode([f.buffer for f in frames])


async def send_async(sock, obj: Any) -> None:
    await sock.send_multipart(encode(obj), copy=False)
