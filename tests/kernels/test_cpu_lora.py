"""kernels/cpu_lora.py: the C bag kernel serves the CPU's float32 decode groups once built and
checked (its sums are checked against float64 over the kernel grid of
test_kernels_cpu_dispatch.py, strategy "bags"), and embedding bags serve otherwise."""

from __future__ import annotations

import torch

from kernels import cpu_lora


def test_the_kernel_is_checked_and_serves_float32_rows():
    assert cpu_lora.self_check() is None
    x, out = torch.randn(4, 16), torch.zeros(4, 8)
    assert cpu_lora.usable(out, x)
    assert not cpu_lora.usable(out.bfloat16(), x.bfloat16())
    assert not cpu_lora.usable(torch.zeros(8, 4).T, x)  # rows not contiguous


def test_a_kernel_that_cannot_build_leaves_the_bags_serving(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("no C compiler (cc or $CC) to build the lora_bags kernel")

    monkeypatch.setattr(cpu_lora, "_kernel", no_compiler)
    monkeypatch.setattr(cpu_lora, "_checked", cpu_lora._checked.__wrapped__)
    assert not cpu_lora.usable(torch.zeros(4, 8), torch.randn(4, 16))
    assert "no C compiler" in caplog.text
