"""Problems for the kernel tests: adapter popularity, mixed ranks, and poisoned inputs.

Every weight element a kernel must not read is NaN (rank padding, slots no token uses), and so
is every row of x whose token has no adapter: a kernel that reads past a rank or gathers the
wrong slot produces NaN and fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

POPULARITIES = ("distinct", "uniform", "zipf", "identical", "skewed", "all-none")
RANKS = (1, 8, 16, 64, 128)
HIDDEN = (33, 64, 257)
TOKENS = (1, 3, 16, 33)
SLOTS = (1, 4, 8)
WIDTHS = ((64,), (48, 17), (40, 8, 8))  # output slices of unequal width (GQA-like qkv)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# |got - want| <= atol + rtol * |want|, per dtype of x/out (kernels accumulate in fp32).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    popularity: str
    rank: int                  # R, the pool's max rank
    dtype: torch.dtype
    T: int
    S: int
    H: int
    widths: tuple[int, ...]
    mixed_ranks: bool          # slots get ranks in {0, 1, R/8, R/2, R}, else all R
    seed: int = 0

    def __str__(self) -> str:
        return (f"{self.popularity}-r{self.rank}-{str(self.dtype)[6:]}-T{self.T}-S{self.S}-H{self.H}"
                f"-w{'x'.join(map(str, self.widths))}{'-mixed' if self.mixed_ranks else ''}")


def covering_cases(axes: dict[str, tuple], seed: int) -> list[Case]:
    """The product of `axes`; every other axis drawn per case from a seeded generator."""
    defaults = {"popularity": POPULARITIES, "rank": RANKS, "dtype": DTYPES, "T": TOKENS,
                "S": SLOTS, "H": HIDDEN, "widths": WIDTHS, "mixed_ranks": (False, True)}
    keys = list(axes)
    combos: list[dict] = [{}]
    for key in keys:
        combos = [{**c, key: v} for c in combos for v in axes[key]]
    cases = []
    for i, combo in enumerate(combos):
        rng = random.Random(seed * 100_003 + i)
        fields = {k: combo[k] if k in combo else rng.choice(v) for k, v in defaults.items()}
        cases.append(Case(**fields, seed=seed * 100_003 + i))
    return cases


def token_slots(popularity: str, T: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int64 slot per token, in no particular order (-1 = no adapter)."""
    perm = torch.randperm(T, generator=gen)
    if popularity == "distinct":        # each token its own adapter while slots last
        slots = torch.arange(T) % S
    elif popularity == "uniform":       # uniform over the slots and "no adapter"
        slots = torch.randint(-1, S, (T,), generator=gen)
    elif popularity == "zipf":          # p(k-th most popular) ~ 1 / k^1.5
        p = 1.0 / torch.arange(1, S + 1, dtype=torch.float64) ** 1.5
        ranked = torch.multinomial(p, T, replacement=True, generator=gen)
        slots = torch.randperm(S, generator=gen)[ranked]
    elif popularity == "identical":
        slots = torch.full((T,), int(torch.randint(S, (1,), generator=gen)))
    elif popularity == "skewed":        # one hot adapter, a few others, some base-only tokens
        slots = torch.randint(-1, S, (T,), generator=gen)
        slots[: (3 * T + 3) // 4] = S - 1
    elif popularity == "all-none":
        slots = torch.full((T,), -1)
    else:
        raise ValueError(popularity)
    return slots[perm]


@dataclass
class Problem:
    x: torch.Tensor                    # [T, H]
    lora_a: torch.Tensor               # [n, S, R, H]
    lora_b: torch.Tensor               # [S, O, R]
    ranks: torch.Tensor                # [n, S] int32
    scales: torch.Tensor               # [n, S] float32
    slice_offsets: tuple[int, ...]     # n+1
    token_slots: torch.Tensor          # [T] int64
    out0: torch.Tensor                 # [T, O] base output the LoRA delta is added to

    def untouched(self) -> torch.Tensor:
        """[T, O] bool: elements no adapter contributes to (slot -1 or rank 0): must stay bitwise."""
        mask = torch.ones(self.out0.shape, dtype=torch.bool)
        offs = self.slice_offsets
        for t, slot in enumerate(self.token_slots.tolist()):
            for i in range(len(offs) - 1):
                if slot >= 0 and int(self.ranks[i, slot]):
                    mask[t, offs[i]:offs[i + 1]] = False
        return mask


def make_problem(case: Case, device: str | torch.device = "cpu") -> Problem:
    gen = torch.Generator().manual_seed(case.seed)
    n, S, R, H, T = len(case.widths), case.S, case.rank, case.H, case.T
    offsets = (0, *torch.tensor(case.widths).cumsum(0).tolist())
    slots = token_slots(case.popularity, T, S, gen)
    if case.mixed_ranks:
        choices = torch.tensor(sorted({0, 1, max(1, R // 8), max(1, R // 2), R}))
        ranks = choices[torch.randint(len(choices), (n, S), generator=gen)]
    else:
        ranks = torch.full((n, S), R)
    x = torch.randn(T, H, generator=gen)
    a = torch.randn(n, S, R, H, generator=gen) / H ** 0.5
    b = torch.randn(S, offsets[-1], R, generator=gen) / R ** 0.5
    used = set(slots.tolist())
    for s in range(S):
        for i in range(n):
            a[i, s, ranks[i, s]:] = float("nan")
            b[s, offsets[i]:offsets[i + 1], ranks[i, s]:] = float("nan")
        if s not in used:
            a[:, s], b[s] = float("nan"), float("nan")
    x[slots < 0] = float("nan")
    return Problem(
        x=x.to(device, case.dtype), lora_a=a.to(device, case.dtype), lora_b=b.to(device, case.dtype),
        ranks=ranks.to(device, torch.int32),
        scales=(0.5 + 1.5 * torch.rand(n, S, generator=gen)).to(device),
        slice_offsets=offsets, token_slots=slots.to(device),
        out0=torch.randn(T, offsets[-1], generator=gen).to(device, case.dtype))


def poisoned_y(problem: Problem, y64: torch.Tensor) -> torch.Tensor:
    """y as lora_expand receives it, NaN wherever expand must not read (cols >= rank, slot -1)."""
    y = y64.float().clone()
    for t, slot in enumerate(problem.token_slots.tolist()):
        for i in range(y.shape[0]):
            y[i, t, int(problem.ranks[i, slot]) if slot >= 0 else 0:] = float("nan")
    return y.to(problem.x.device)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    got = got.double().cpu()
    assert not got.isnan().any(), f"{what}: NaN in output (read a poisoned element or left one unwritten)"
    torch.testing.assert_close(got, want.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def must_write(problem: Problem, R: int) -> torch.Tensor:
    """[n, T, R] bool: elements of y lora_shrink must write (slot >= 0 and column < rank)."""
    n, T = problem.ranks.shape[0], problem.x.shape[0]
    mask = torch.zeros(n, T, R, dtype=torch.bool)
    for t, slot in enumerate(problem.token_slots.tolist()):
        for i in range(n):
            mask[i, t, : int(problem.ranks[i, slot]) if slot >= 0 else 0] = True
    return mask


def run_checks(problem: Problem, case: Case, backend: str, meta, shrink_into=None) -> None:
    """apply_lora, lora_shrink and lora_expand of `backend` against the float64 oracle.

    shrink_into(x, lora_a, ranks, meta, y): the backend's own shrink, called on a y that is NaN
    where it must write and zero elsewhere (skip it for split-K, which adds into zeros)."""
    from loragw.kernels import apply_lora, lora_expand, lora_shrink
    from loragw.kernels.reference import oracle_expand, oracle_shrink

    p, dev = problem, problem.x.device
    untouched = p.untouched().to(dev)
    y64 = oracle_shrink(p.x, p.lora_a, p.ranks, p.token_slots)                    # [n, T, R]
    want = oracle_expand(p.out0, y64, p.lora_b, p.ranks, p.scales, p.slice_offsets, p.token_slots)

    out = p.out0.clone()
    apply_lora(out, p.x, p.lora_a, p.lora_b, p.ranks, p.scales, p.slice_offsets, meta, backend)
    assert torch.equal(out[untouched], p.out0[untouched]), f"{case}: apply_lora wrote rows it must not"
    assert_close(out, want, case.dtype, f"{case}: apply_lora")

    y = lora_shrink(p.x, p.lora_a, p.ranks, meta, backend)
    assert_close(y, y64, torch.float32, f"{case}: lora_shrink")
    must = must_write(p, case.rank).to(dev)
    assert torch.equal(y[~must], torch.zeros_like(y[~must])), f"{case}: y not zero outside rank/slot"
    if shrink_into is not None:
        y = torch.zeros_like(y).masked_fill_(must, float("nan"))
        shrink_into(p.x, p.lora_a, p.ranks, meta, y)
        assert_close(y, y64, torch.float32, f"{case}: shrink into poisoned y")

    out = p.out0.clone()
    y_in = poisoned_y(p, y64)
    want_from_y = oracle_expand(p.out0, y_in.nan_to_num(0.0), p.lora_b, p.ranks, p.scales,
                                p.slice_offsets, p.token_slots)
    lora_expand(out, y_in, p.lora_b, p.ranks, p.scales, p.slice_offsets, meta, backend)
    assert torch.equal(out[untouched], p.out0[untouched]), f"{case}: lora_expand wrote rows it must not"
    assert_close(out, want_from_y, case.dtype, f"{case}: lora_expand")
