"""Test material for the rollout engines: vLLM's marks, and one torch thread for tiny models."""

import importlib.util
from contextlib import contextmanager

import pytest
import torch

VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def needs_vllm(test):
    for mark in VLLM_MARKS:
        test = mark(test)
    return test


@contextmanager
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spin-waiting made these tests 5x slower (vLLM serves with 1 thread for the same reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
