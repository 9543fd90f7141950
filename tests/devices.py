"""The devices tests run on: the CPU always, CUDA (tests marked `gpu`) where a CUDA device exists."""
import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = [pytest.mark.gpu, needs_cuda]  # pytestmark of a module of GPU-only tests
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]  # see the `device` fixture (conftest)
