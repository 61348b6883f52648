"""CUDA stream handles as torch streams: what a copy issued from a handle (a copy queue's) uses for its torch ops.

Stateless; any thread.
"""

from __future__ import annotations

import contextlib

import torch


def torch_stream(handle: int | None, device: torch.device | str | None = None):
    """The torch stream of CUDA stream handle ``handle`` (None: the current stream). Handle 0 is the legacy default
    stream: ``torch.cuda.ExternalStream(0)`` is not it but a new stream from torch's pool, which does not wait for
    the default stream's work nor it for its own (copies issued there raced the kernels issued on handle 0)."""
    current = torch.cuda.current_stream(device)
    if handle is None or handle == current.cuda_stream:
        return current
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


@contextlib.contextmanager
def on_stream(stream: int | None, device: torch.device | str | None = None):
    """Make the CUDA stream of handle ``stream`` torch's current stream (a job's torch ops); nothing off CUDA."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(torch_stream(stream, device)):
        yield
