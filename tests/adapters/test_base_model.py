"""adapters.format against the base model adapter_config.json names: an adapter trained on
another architecture class is refused, one that only names its base differently is served with a
warning. Adapters are saved by real PEFT on real tiny checkpoints (tests/checkpoints.py)."""

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
from peft_saving import load_edited

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import BaseModelSpec, read_adapter
from loragw.adapters.lora_config import parse_adapter_config
from loragw.engine.models import adapter_spec

LLAMA = "LlamaForCausalLM"
HUB_ID = "meta-llama/Llama-3.1-8B"
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
# name -> (the base's name_or_path, extra PEFT LoraConfig kwargs); each is saved from the tiny
# Llama loaded with from_pretrained, so PEFT records the model's name_or_path (the checkpoint's
# path, unless renamed to what from_pretrained(HUB_ID) leaves) and, without task_type, auto_mapping
VARIANTS = {
    "llama": (None, {}),
    "hub_named": (HUB_ID, {}),
    "causal_lm": (None, {"task_type": "CAUSAL_LM"}),  # PEFT writes no auto_mapping with this
}


@pytest.fixture(scope="module")
def bases(tiny_checkpoint) -> dict[str, str]:
    """arch -> the directory of a tiny random checkpoint, all with the same LoRA shapes."""
    return {arch: tiny_checkpoint(arch) for arch in ("llama", "mistral", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def saved(bases, tmp_path_factory) -> dict[str, Path]:
    """name -> the folder PEFT's save_pretrained wrote for that VARIANT."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    out = {}
    for name, (name_or_path, extra) in VARIANTS.items():
        base = LlamaForCausalLM.from_pretrained(bases["llama"])
        base.name_or_path = name_or_path or base.name_or_path
        model = get_peft_model(base, LoraConfig(**LORA, **extra))
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name], save_embedding_layers=False)  # no Hub lookup
    return out


def read_json(folder: str | Path, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def served(model_dir: str, **config_changes) -> BaseModelSpec:
    """The spec the engine builds for model_dir, after changes to its config.json."""
    hf_config = {**read_json(model_dir, "config.json"), **config_changes}
    return adapter_spec(hf_config, 16, model_path=model_dir)


def adapter_config(path: Path) -> dict:
    return read_json(path, "adapter_config.json")


def test_peft_records_what_the_checks_read(bases, saved):
    """What real PEFT writes, and what the engine's spec holds, so the tests below mean something."""
    config = adapter_config(saved["llama"])
    assert config["base_model_name_or_path"] == bases["llama"]
    assert config["auto_mapping"]["base_model_class"] == LLAMA
    assert adapter_config(saved["hub_named"])["base_model_name_or_path"] == HUB_ID
    assert adapter_config(saved["causal_lm"])["auto_mapping"] is None
    parsed = parse_adapter_config(json.dumps(config))
    assert (parsed.base_model_name_or_path, parsed.base_model_class) == (bases["llama"], LLAMA)
    spec = served(bases["llama"])
    assert spec.architecture == LLAMA
    assert spec.model_names == (os.path.basename(bases["llama"]),)
    hf_config = read_json(bases["llama"], "config.json")
    assert adapter_spec(hf_config, 16, model_path=bases["llama"] + "/") == spec
    assert served(bases["qwen2"], _name_or_path=HUB_ID).model_names[1:] == (HUB_ID,)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_adapter_for_another_class_is_refused_naming_both(bases, saved, arch, monkeypatch,
                                                          caplog):  # fmt: skip
    spec = served(bases[arch])
    assert spec.architecture not in (None, LLAMA)
    monkeypatch.setattr(safetensors.torch, "load", lambda *a: pytest.fail("deserialized"))
    with caplog.at_level(logging.WARNING), pytest.raises(AdapterError) as info:
        read_adapter(saved["llama"], spec)
    assert info.value.status == 422
    assert str(info.value) == (
        f"adapter_config.json says the adapter was trained on '{LLAMA}'"
        f" (auto_mapping.base_model_class), but this server serves '{spec.architecture}'; use an"
        f" adapter trained on '{spec.architecture}', or serve this one on a '{LLAMA}' base model"
    )
    assert not caplog.records  # refused before anything was read past the config, or logged


def test_unknown_class_on_either_side_is_not_refused(bases, saved):
    assert read_adapter(saved["causal_lm"], served(bases["qwen2"])).modules  # no auto_mapping
    # the engine serves only a named architecture; a spec that names none is built directly
    no_archs = dataclasses.replace(served(bases["qwen2"]), architecture=None)
    assert no_archs.architecture is None
    assert read_adapter(saved["llama"], no_archs).modules


def test_another_base_name_is_served_with_one_warning(bases, saved, caplog):
    spec = served(bases["llama"])
    with caplog.at_level(logging.WARNING, logger="loragw.adapters.format"):
        adapter = read_adapter(saved["hub_named"], spec)
    assert adapter.modules and adapter.targets == ("q_proj", "v_proj")
    assert adapter.warnings == (
        f"adapter_config.json says it was trained on '{HUB_ID}'; this server serves"
        f" '{os.path.basename(bases['llama'])}' (shapes match, so it is served; check it is the"
        " right base)",
    )
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert adapter.warnings[0] in caplog.records[0].getMessage()
    assert adapter.sha256[:12] in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("adapter_says", "served_name_or_path"),
    [
        (None, None),  # the checkpoint's own path, as PEFT recorded it
        ("someone/{dir}", None),  # a Hub id whose last component is the served directory's name
        ("SOMEONE/{DIR}//", None),  # case and trailing slashes do not matter
        (HUB_ID, HUB_ID),  # config.json's _name_or_path, in full
        (HUB_ID, "/models/llama-3.1-8b/"),  # ... or its last component
        ("", None),  # an empty name says nothing
    ],
)
def test_a_matching_name_gives_no_warning(bases, saved, caplog, adapter_says,
                                          served_name_or_path):  # fmt: skip
    dirname = os.path.basename(bases["llama"])
    changes = {}
    if adapter_says is not None:
        changes["base_model_name_or_path"] = adapter_says.format(dir=dirname, DIR=dirname.upper())
    spec = served(bases["llama"], **({"_name_or_path": served_name_or_path}
                                     if served_name_or_path else {}))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        adapter = load_edited(saved["llama"], spec, config_changes=changes)
    assert adapter.modules and adapter.warnings == ()
    assert not caplog.records


def test_adapters_without_the_fields_load_silently(bases, saved, caplog):
    unnamed = {"base_model_name_or_path": None, "auto_mapping": None}
    with caplog.at_level(logging.WARNING):
        adapter = load_edited(saved["llama"], served(bases["qwen2"]), config_changes=unnamed)
        bare = adapter_config(saved["llama"])
        del bare["base_model_name_or_path"], bare["auto_mapping"]
        parsed = parse_adapter_config(bare)
    assert adapter.modules and adapter.warnings == ()
    assert (parsed.base_model_name_or_path, parsed.base_model_class) == (None, None)
    assert not caplog.records


def test_a_spec_without_model_path_checks_no_names(bases, saved):
    """Every caller but the engine builds its spec without model_path, as before."""
    spec = adapter_spec(read_json(bases["llama"], "config.json"), 16)
    assert (spec.architecture, spec.model_names) == (LLAMA, ())
    assert read_adapter(saved["hub_named"], spec).warnings == ()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"base_model_name_or_path": 7}, "base_model_name_or_path must be a string or null, got 7"),
        ({"auto_mapping": "LlamaForCausalLM"}, "auto_mapping must be an object or null"),
        ({"auto_mapping": {"base_model_class": ["LlamaForCausalLM"]}},
         r"auto_mapping.base_model_class must be a string or null, got \['LlamaForCausalLM'\]"),
    ],
)  # fmt: skip
def test_wrong_types_are_refused_naming_the_field(saved, changes, message):
    with pytest.raises(AdapterError, match=message) as info:
        parse_adapter_config({**adapter_config(saved["llama"]), **changes})
    assert info.value.status == 422
