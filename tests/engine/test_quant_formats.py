"""A corrupt quantized checkpoint is refused with a ValueError naming the tensor, never a bare
AssertionError (which `python -O` would also drop): packed words stored as float32."""

from __future__ import annotations

import pytest
import torch

from loragw.engine.quant.formats import convert
from loragw.engine.quant.scheme import read_quantization

MODULE = "model.layers.0.mlp.down_proj"
ROWS, COLUMNS, GROUP = 8, 64, 32
W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
          "group_size": GROUP}}}, "ignore": ["lm_head"]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}


def _compressed(words_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"weight_packed": torch.zeros(ROWS, COLUMNS // 8, dtype=words_dtype),
            "weight_scale": torch.ones(ROWS, COLUMNS // GROUP),
            "weight_shape": torch.tensor([ROWS, COLUMNS])}


def _gptq(words_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"qweight": torch.zeros(COLUMNS // 8, ROWS, dtype=words_dtype),
            "qzeros": torch.zeros(COLUMNS // GROUP, ROWS // 8, dtype=torch.int32),
            "scales": torch.ones(COLUMNS // GROUP, ROWS, dtype=torch.float16)}


@pytest.mark.parametrize(("quantization", "parts", "tensor"), [
    (W4, _compressed, "weight_packed"), (GPTQ, _gptq, "qweight")])
def test_float_packed_words_are_a_named_error(quantization, parts, tensor):
    config = read_quantization(quantization, "auto")
    scheme = config.scheme(MODULE)
    assert convert(config, scheme, MODULE, parts(torch.int32)).qweight is not None  # the setup
    with pytest.raises(ValueError, match=f"{MODULE}.{tensor} is torch.float32, expected "
                                         "torch.int32") as refused:
        convert(config, scheme, MODULE, parts(torch.float32))
    assert not isinstance(refused.value, AssertionError)
