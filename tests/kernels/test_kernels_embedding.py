"""embedding_lora (embed_tokens' LoRA) against its float64 per-token oracle, on every backend,
over adapter popularities and mixed ranks; NaN wherever the op must not read. On CUDA the
tensors live on the GPU (compiled Triton); on CPU Triton runs under the interpreter."""

import pytest
import torch
from lora_cases import DTYPES, POPULARITIES, TOLERANCE, token_slots

from loragw.kernels import BACKENDS, embedding_lora, make_lora_meta
from loragw.kernels.reference import oracle_embedding_lora

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(popularity, dtype, mixed) for popularity in POPULARITIES for dtype in DTYPES
         for mixed in (False, True)]


def embedding_problem(popularity: str, dtype: torch.dtype, mixed: bool, seed: int, T=33, S=4,
                      V=50, H=40, R=16):
    gen = torch.Generator().manual_seed(seed)
    slots = token_slots(popularity, T, S, gen)                       # [T]
    choices = torch.tensor([0, 1, 2, 8, R]) if mixed else torch.tensor([R])
    ranks = choices[torch.randint(len(choices), (1, S), generator=gen)].to(torch.int32)
    a = torch.randn(S, V, R, generator=gen)                           # lora_embedding_A.T
    b = torch.randn(S, H, R, generator=gen) / R ** 0.5               # lora_embedding_B
    used = set(slots.tolist())
    for s in range(S):
        a[s, :, ranks[0, s]:] = b[s, :, ranks[0, s]:] = float("nan")  # rank padding
        if s not in used:
            a[s] = b[s] = float("nan")
    p = dict(ids=torch.randint(V, (T,), generator=gen), lora_a=a.to(dtype), lora_b=b.to(dtype),
             ranks=ranks, scales=0.5 + 1.5 * torch.rand(1, S, generator=gen))
    return ({k: v.to(DEVICE) for k, v in p.items()}, slots.to(DEVICE),
            torch.randn(T, H, generator=gen).to(DEVICE, dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("popularity", "dtype", "mixed"), CASES,
                         ids=[f"{p}-{str(d)[6:]}{'-mixed' if m else ''}" for p, d, m in CASES])
def test_embedding_lora_matches_oracle(backend, popularity, dtype, mixed):
    p, slots, out0 = embedding_problem(popularity, dtype, mixed, seed=len(popularity))
    out = out0.clone()
    embedding_lora(out, meta=make_lora_meta(slots, p["lora_a"].shape[0]), backend=backend, **p)
    want = oracle_embedding_lora(out0, token_slots=slots, **p)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
    adapted = (slots >= 0) & (p["ranks"][0, slots.clamp(min=0)] > 0)
    assert torch.equal(out[~adapted], out0[~adapted]), "rows without an adapter must not change"
