"""kernels/cpu_lora.py: the C bag kernel serves the CPU's float32 decode groups once built and
checked (its sums are checked against float64 over the kernel grid of
test_kernels_cpu_dispatch.py, strategy "bags"), and embedding bags serve otherwise."""

from __future__ import annotations

import torch

from loragw.kernels import cpu_lora


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


def test_a_tokens_delta_does_not_depend_on_the_tokens_walked_beside_it():
    """Threads walk up to four tokens side by side: every token count (partial groups too), with
    an index of rows, gives each token the bits it gets alone, and float64's sums."""
    from loragw.kernels.cpu_dispatch import GatherGroup, _build_tables

    g = torch.Generator().manual_seed(5)
    S, H, edges = 6, 40, (0, 24, 36, 52)
    ranks = torch.randint(0, 9, (3, S), generator=g)
    tables = _build_tables(torch.randn(3, S, 8, H, generator=g),
                           torch.randn(S, 52, 8, generator=g), ranks,
                           torch.rand(3, S, generator=g), edges, ())
    offsets = tuple(zip(edges, edges[1:]))
    for T in (2, 3, 7, 8, 9, 13):
        x, base = torch.randn(T + 2, H, generator=g), torch.randn(T + 2, 52, generator=g)
        rows = torch.randperm(T + 2, generator=g)[:T]
        slots = torch.randint(0, S, (T,), generator=g)
        together = base.clone()
        cpu_lora.apply_bags(together, x, tables, [0, 1, 2], offsets,
                            GatherGroup(rows, slots, tuple(range(S)), T))
        alone = base.clone()
        for t in range(T):
            cpu_lora.apply_bags(alone, x, tables, [0, 1, 2], offsets,
                                GatherGroup(rows[t:t + 1], slots[t:t + 1], tuple(range(S)), 1))
        assert torch.equal(together, alone), T
        want = base.double()
        a = tables.a.double().view(S, H, -1)
        for row, slot in zip(rows.tolist(), slots.tolist()):
            y = x[row].double() @ a[slot]
            for i, (lo, hi) in enumerate(offsets):
                c0, c1 = tables.cols[i], tables.cols[i + 1]
                if tables.b[i] is not None:
                    want[row, lo:hi] += y[c0:c1] @ tables.b[i].double().view(S, c1 - c0, -1)[slot]
        torch.testing.assert_close(together.double(), want, rtol=1e-5, atol=1e-4)
