"""Loading a checkpoint (engine/models/loader.py): a tensor that is not finite in the served dtype,
NaN or inf in the file, or a value past float16's range under --dtype float16, is refused at
load with an error naming the tensor, its largest magnitude and the dtypes that hold it; the
same checkpoint loads in bfloat16 and float32."""

import math

import pytest
from checkpoints import with_weight

from loragw.engine import LLM, SamplingParams

DOWN = "model.layers.1.mlp.down_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # a slice of the merged qkv_proj


@pytest.fixture(scope="module")
def overflowing(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny llama with one down_proj weight at -1e5: inf in float16 (largest 65504)."""
    return with_weight(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("fp16-overflow")),
                       DOWN, (3, 7), -1e5)


def test_float16_refuses_a_weight_past_its_range(overflowing):
    with pytest.raises(ValueError) as refused:
        LLM(overflowing, device="cpu", dtype="float16")
    message = str(refused.value)
    for part in (f"checkpoint tensor {DOWN!r}", "values up to 1e+05 in magnitude",
                 "float16's largest (65504)", "--dtype bfloat16 or --dtype float32"):
        assert part in message, message


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_wider_dtypes_load_the_same_checkpoint(overflowing, dtype):
    llm = LLM(overflowing, device="cpu", dtype=dtype)
    weight = llm.engine.runner.model.model.layers[1].mlp.down_proj.dense_weight()
    assert math.isclose(weight[3, 7].item(), -1e5, rel_tol=1e-2)  # bf16 keeps 8 bits
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out.token_ids) == 2


def test_nan_in_the_checkpoint_is_refused_in_any_dtype(tiny_checkpoint, tmp_path):
    """Named by its checkpoint name, though it loads into a slice of qkv_proj."""
    broken = with_weight(tiny_checkpoint("llama"), str(tmp_path), K_PROJ, (0, 0), math.nan)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{K_PROJ}' holds 1 NaN or "
                                         r"infinite values: the checkpoint is corrupt"):
        LLM(broken, device="cpu", dtype="float32")
