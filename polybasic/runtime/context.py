"""The execution context: device, dtype and seed, checked once at the edge (CLI, recipe,
`runtime.load`) and passed down; it makes the generators and times with device synchronization.

Everything below the edge takes a device from here (or from the model it works on), never a
"cpu" default of its own: a chain's levels, its generator and its timer live on one device.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from polybasic.errors import ConfigError
from polybasic.models.loader import parse_dtype
from polybasic.runtime.sampling import make_generator

DEVICE_TYPES = ("cpu", "cuda")


def parse_device(device: str | torch.device, flag: str = "--device") -> torch.device:
    """The torch.device `device` names (cpu, cuda, cuda:N), whether or not this machine has it (a
    recipe for a GPU cluster is read anywhere); else a ConfigError naming `flag`."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{flag}: unknown device '{device}'; use cpu, cuda or cuda:N") from None
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"{flag}: device type '{dev.type}' is not supported; use cpu, cuda or cuda:N")
    return dev


def check_device(device: str | torch.device, flag: str = "--device") -> torch.device:
    """The torch.device `device` names, if this machine has it; else a ConfigError naming `flag`."""
    dev = parse_device(device, flag)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag}: '{device}' asked for, but this machine has no usable CUDA device (torch "
                              f"{torch.__version__}); pass {flag} cpu, or install a CUDA build of torch on a GPU "
                              "machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{flag}: '{device}' does not exist (this machine has {torch.cuda.device_count()} "
                              f"CUDA device(s)); pass {flag} cuda:0")
    return dev


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU, whose ops are synchronous."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextmanager
def timed(device: str | torch.device) -> Iterator[Elapsed]:
    """`with timed(dev) as t: ...` then t.seconds: the block's wall time, the device synchronized at
    both ends (so queued CUDA work is counted where it was issued)."""
    synchronize(device)
    out, t0 = Elapsed(), time.perf_counter()
    try:
        yield out
    finally:
        synchronize(device)
        out.seconds = time.perf_counter() - t0


@dataclass
class ExecutionContext:
    """Where and how to run: device ('cpu', 'cuda', 'cuda:N'), the weights' dtype name, the seed
    (None: a random one per generator). `flag` names the option or recipe field in errors."""
    device: str = "cpu"
    dtype: str = "float32"
    seed: int | None = None
    flag: str = "--device"

    def __post_init__(self) -> None:
        self.torch_device = check_device(self.device, self.flag)
        self.device = str(self.torch_device)
        self.torch_dtype = parse_dtype(self.dtype)

    def generator(self, seed: int | None = None) -> torch.Generator:
        """A generator on this device, seeded with `seed` (default: the context's seed)."""
        return make_generator(self.seed if seed is None else seed, self.torch_device)

    def synchronize(self) -> None:
        synchronize(self.torch_device)

    def timer(self):
        """`with ctx.timer() as t: ...` then t.seconds (see timed)."""
        return timed(self.torch_device)
