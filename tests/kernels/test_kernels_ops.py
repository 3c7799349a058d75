"""The public calls: backend dispatch, lazy Triton import, empty batches, shape errors."""

import subprocess
import sys

import pytest
import torch

from loragw.kernels import BACKENDS, apply_lora, lora_expand, lora_shrink, make_lora_meta


def small(T=3, S=2, H=16, R=4, widths=(8, 4)):
    offsets = (0, widths[0], sum(widths))
    return dict(x=torch.randn(T, H), lora_a=torch.randn(len(widths), S, R, H),
                lora_b=torch.randn(S, offsets[-1], R),
                ranks=torch.full((len(widths), S), R, dtype=torch.int32),
                scales=torch.ones(len(widths), S), slice_offsets=offsets)


def test_importing_kernels_does_not_import_triton():
    code = "import sys, loragw.kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_unknown_backend_names_the_choices():
    p = small()
    meta = make_lora_meta(torch.tensor([0, 1, -1]), 2)
    with pytest.raises(ValueError, match="must be one of torch, triton; got 'cuda'"):
        lora_shrink(p["x"], p["lora_a"], p["ranks"], meta, backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_is_a_no_op(backend):
    p = small(T=0)
    out = torch.zeros(0, 12)
    meta = make_lora_meta(torch.zeros(0, dtype=torch.long), 2)
    apply_lora(out, meta=meta, backend=backend, **p)
    assert lora_shrink(p["x"], p["lora_a"], p["ranks"], meta, backend).shape == (2, 0, 4)


def test_shape_mismatches_say_what_was_expected():
    p = small()
    meta = make_lora_meta(torch.tensor([0, 1, -1]), 2)
    with pytest.raises(AssertionError, match=r"x must be \[T, 16\]"):
        lora_shrink(torch.randn(3, 15), p["lora_a"], p["ranks"], meta)
    with pytest.raises(AssertionError, match="x has 3 tokens, meta has 2"):
        lora_shrink(p["x"], p["lora_a"], p["ranks"], make_lora_meta(torch.tensor([0, 1]), 2))
    y = torch.zeros(2, 3, 4)
    with pytest.raises(AssertionError, match=r"slice_offsets must run 0 .. 12"):
        lora_expand(torch.zeros(3, 12), y, p["lora_b"], p["ranks"], p["scales"], (0, 12), meta)
