"""engine/config.py's `--dtype auto`: on a CPU bfloat16 only where it has bf16 units (AMX-BF16 or
AVX-512 BF16), float32 on every other CPU (a plain AVX2 machine keeps float32), decided from the
flags line given (never this machine's) and logged once with its reason; CUDA's rule unchanged."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from loragw.engine import config
from loragw.engine.config import EngineOptions, cpu_auto_dtype, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BASE = "flags\t\t: fpu vme de pse tsc msr pae sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2"
SAPPHIRE_RAPIDS = BASE + (" avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16"
                          " avx512_fp16 amx_tile amx_int8")
ZEN4 = BASE + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
ICE_LAKE = BASE + " avx512f avx512dq avx512bw avx512vl avx512_vnni"  # AVX-512, no bf16 units
ZEN3 = BASE + " vaes vpclmulqdq"  # AVX2 only, as the machine the tests were written on


@pytest.mark.parametrize("flags,want,named", [
    (SAPPHIRE_RAPIDS, torch.bfloat16, "amx_bf16 and avx512_bf16"),
    (ZEN4, torch.bfloat16, "avx512_bf16"),
    (ICE_LAKE, torch.float32, "neither"),
    (ZEN3, torch.float32, "neither"),
    ("", torch.float32, "neither"),  # no /proc/cpuinfo
    (BASE + " avx512_bf16_like", torch.float32, "neither"),  # whole flags only
])
def test_auto_is_bfloat16_only_on_cpus_with_bf16_units(flags, want, named):
    dtype, reason = cpu_auto_dtype(flags)
    assert dtype == want and named in reason


@pytest.mark.parametrize("flags,want", [(SAPPHIRE_RAPIDS, torch.bfloat16), (ZEN3, torch.float32)])
def test_an_auto_cpu_engine_follows_its_cpu_and_says_why_once(monkeypatch, caplog, flags, want):
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    config._this_cpu_auto_dtype.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=config.__name__):
            assert resolve_dtype("auto", CPU, "bfloat16") == want
            assert resolve_dtype("auto", CPU, "float32") == want  # the checkpoint's: not on a CPU
        lines = [r.getMessage() for r in caplog.records if "--dtype auto" in r.getMessage()]
        assert len(lines) == 1 and str(want).removeprefix("torch.") in lines[0], lines
    finally:
        config._this_cpu_auto_dtype.cache_clear()


def test_a_named_dtype_and_cuda_ignore_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(config, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    assert resolve_dtype("float32", CPU, None) == torch.float32
    assert resolve_dtype("float16", CPU, None) == torch.float16
    assert resolve_dtype("auto", CUDA, "float16") == torch.float16  # the checkpoint's
    assert resolve_dtype("auto", CUDA, None) == torch.bfloat16
    # the default: $LORAGW_DTYPE (tests/conftest.py pins float32 for the session), else auto
    assert EngineOptions().dtype == os.environ.get("LORAGW_DTYPE", "auto") == "float32"
