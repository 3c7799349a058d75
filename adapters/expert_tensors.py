"""LoRAs on an MoE block's parameters (PEFT's target_parameters), checked from the safetensors
header against the adapter config and the served base model, and their factors de-interleaved.

PEFT wraps each targeted nn.Parameter in a ParamWrapper; two on one module nest, the first
parameter of the module (gate_up_proj) innermost, so on a block with both targeted:
    mlp.experts.base_layer.lora_A.weight  [E*r, H]    lora_B [2I, E*r]   experts.gate_up_proj
    mlp.experts.lora_A.weight             [E*r, I]    lora_B [H, E*r]    experts.down_proj
    mlp.gate.lora_A.weight                [r, H]      lora_B [E, r]      gate.weight (router)
With only one of the experts' parameters targeted, it is the unnested "mlp.experts.lora_A".
An expert LoRA's factors interleave the experts (ParamWrapper.get_delta_weight): row e*r + j
of lora_A and column j*E + e of lora_B belong to expert e, and
    delta_W[e] = scaling * B[:, j*E + e for j < r] @ A[e*r : (e+1)*r]    [out, in]
in the orientation of transformers' [E, out, in] parameter. The router is a plain 2D LoRA.
PEFT matches rank_pattern / alpha_pattern against the parameter's full name
('model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.gate.weight').
"""

from __future__ import annotations

import re

import torch

from loragw.adapters.errors import AdapterError
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.safetensors_check import CONFIG_FILE, TensorInfo
from loragw.adapters.types import EXPERT_PARAMS, EXPERTS, ROUTER, BaseModelSpec, LoraConfig

PARAM_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?:model\.)?layers\.(?P<layer>0|[1-9][0-9]{0,5})\.mlp\."
    r"(?P<holder>experts|gate))(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])(?:\.default)?"
    r"\.weight"
)

Plan = dict[tuple[int | None, str], tuple[str, str, str]]


def _params_of(holder: str) -> tuple[str, ...]:
    return EXPERT_PARAMS if holder == EXPERTS else ("weight",)


def check_parameter_tensors(header: dict[str, TensorInfo], config: LoraConfig,
                            spec: BaseModelSpec) -> tuple[Plan, int]:
    """Check every parameter-LoRA tensor of `header` (those PARAM_LORA_KEY matches; the caller
    skips them). Returns ((layer, target) -> (parameter name, lora_A key, lora_B key), the
    largest rank, 0 if none); targets are "experts.gate_up_proj", "experts.down_proj", "gate"."""
    keys = [k for k in header if PARAM_LORA_KEY.fullmatch(k)]
    if (config.target_parameters or keys) and not spec.num_experts:
        raise AdapterError(
            f"{CONFIG_FILE} sets target_parameters {_show(list(config.target_parameters))}, but"
            " the base model is not a mixture of experts (its config.json has no num_experts /"
            " num_local_experts); serve it on the MoE base it was trained on"
        )
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        m = PARAM_LORA_KEY.fullmatch(key)
        layer, holder, module = int(m["layer"]), m["holder"], m["module"]
        if layer not in spec.moe_layers:
            raise AdapterError(f"tensor {_show(key)} is for layer {layer}, which has no experts"
                               f" in the base model (its MoE layers: {list(spec.moe_layers)})")
        # the targeted parameters of this module, innermost wrapper first
        targeted = [p for p in _params_of(holder) if config.targets_parameter(f"{module}.{p}")]
        depth = m["nest"].count(".base_layer")
        if depth >= len(targeted):
            raise AdapterError(
                f"tensor {_show(key)} is a LoRA on a parameter of {_show(module)} that {CONFIG_FILE}"
                f" does not target (target_parameters={_show(list(config.target_parameters))})")
        param = f"{module}.{targeted[len(targeted) - 1 - depth]}"
        slot = found.setdefault((layer, param), {})
        if m["ab"] in slot:
            raise AdapterError(f"tensor {_show(key)} duplicates the lora_{m['ab']} of {param}")
        slot[m["ab"]] = key
    plan, worst = {}, 0
    for (layer, param), slot in sorted(found.items()):
        for ab in ("A", "B"):
            if ab not in slot:
                raise AdapterError(f"parameter {_show(param)} has no lora_{ab} tensor")
        target = _target(param)
        rank = _check_shapes(param, target, header[slot["A"]], header[slot["B"]], spec)
        if rank != config.rank_for(param):
            raise AdapterError(f"parameter {_show(param)} has rank {rank} but {CONFIG_FILE} says"
                               f" {config.rank_for(param)} (r / rank_pattern)")
        worst = max(worst, rank)
        plan[(layer, target)] = (param, slot["A"], slot["B"])
    return plan, worst


def _target(param: str) -> str:
    """'model.layers.0.mlp.experts.gate_up_proj' -> 'experts.gate_up_proj'; '...gate.weight'
    -> 'gate'."""
    holder, name = param.split(".")[-2:]
    return ROUTER if holder == ROUTER else f"{holder}.{name}"


def _check_shapes(param: str, target: str, a: TensorInfo, b: TensorInfo,
                  spec: BaseModelSpec) -> int:
    """The rank of one parameter LoRA whose factors have the shapes PEFT saves on this base."""
    out_f, in_f = spec.module_shapes[target]
    E = 1 if target == ROUTER else spec.num_experts
    a_shape, b_shape = list(a.shape), list(b.shape)
    ok = (len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] % E == 0 and a_shape[0] > 0
          and a_shape[1] == in_f and b_shape == [out_f, a_shape[0]])
    if not ok:
        rows = "r" if E == 1 else f"{E}*r"
        raise AdapterError(
            f"parameter {_show(param)} has lora_A {a_shape} and lora_B {b_shape}; the base model"
            f" needs lora_A [{rows}, {in_f}] and lora_B [{out_f}, {rows}]"
            + ("" if E == 1 else f" ({E} experts)") + "; was the adapter trained for a different"
            " base model?"
        )
    return a_shape[0] // E


def expert_factors(a: torch.Tensor, b: torch.Tensor,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's interleaved expert factors, one matrix per expert: a [E*r, in] -> [E, r, in],
    b [out, E*r] -> [E, out, r], so delta_W[e] = scaling * b[e] @ a[e]."""
    E = num_experts
    lora_a = a.reshape(E, -1, a.shape[1]).contiguous()  # row e*r + j -> [e, j]
    lora_b = b.reshape(b.shape[0], -1, E).permute(2, 0, 1).contiguous()  # column j*E + e
    return lora_a, lora_b
