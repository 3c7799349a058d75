"""Saved modules (PEFT modules_to_save on embed_tokens and lm_head): PEFT-made adapters load
exactly as PEFT reloads them, with the key layout PEFT really writes; they are refused unless
the server has full-module slots, and malformed ones are refused naming what is wrong."""

import pytest
import torch
from peft_saving import (
    EMBED,
    HEAD,
    TINY,
    load_edited,
    lora_weights,
    module_key,
    save_with_peft,
    saved_files,
    saved_weights,
    without_vocabulary,
)

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import BaseModelSpec, read_adapter
from loragw.adapters.lora_config import parse_adapter_config
from loragw.engine.models import adapter_spec

FLAG = "--max-full-module-slots"
# name -> (tie_word_embeddings, peft LoraConfig kwargs)
VARIANTS = {
    "head": (False, dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "embed": (False, dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                          modules_to_save=["embed_tokens"])),
    "both": (False, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                         modules_to_save=["model.embed_tokens", "lm_head"])),
    # lm_head both targeted and saved: PEFT saves the copy and makes no LoRA for it
    "head-targeted-and-saved": (False, dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                            modules_to_save=["lm_head"])),
    "embed-lora-saved-head": (False, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"],
                                          modules_to_save=["lm_head"])),
    "tied-head": (True, dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "tied-weight-tying": (True, dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                     modules_to_save=["embed_tokens"], ensure_weight_tying=True)),
}  # fmt: skip


def spec_for(tied: bool, slots: int = 2, **overrides) -> BaseModelSpec:
    config = {**TINY, "tie_word_embeddings": tied, **overrides}
    return adapter_spec(config, max_lora_rank=16, max_full_module_slots=slots)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each VARIANT saved by PEFT, and what PeftModel.from_pretrained reloads from it."""
    out = {}
    for name, saved_by_peft in save_with_peft(VARIANTS, tmp_path_factory).items():
        reloaded = saved_by_peft.reloaded
        lora = {module_key(n): (a.detach().clone(), b.detach().clone())
                for n, a, b, _ in lora_weights(reloaded)}
        saved = {target: w.detach().clone() for target, w in saved_weights(reloaded)}
        ties = [w for _, w in saved_weights(reloaded)]
        tied = VARIANTS[name][0]
        out[name] = (saved_by_peft.path, lora, saved, spec_for(tied), len({w.data_ptr() for w in ties}))
    return out


def files(made, name: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    return saved_files(made[name][0])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_load_matches_peft(made, name):
    path, lora, saved, spec, distinct = made[name]
    adapter = read_adapter(path, spec)
    assert sorted(adapter.modules, key=str) == sorted(lora, key=str)
    for key, (a, b) in lora.items():
        torch.testing.assert_close(adapter.modules[key].lora_a, a, rtol=0, atol=0)
        torch.testing.assert_close(adapter.modules[key].lora_b, b, rtol=0, atol=0)
    assert sorted(adapter.saved_modules) == sorted(saved)
    for target, weight in saved.items():
        torch.testing.assert_close(adapter.saved_modules[target], weight, rtol=0, atol=0)
    # PEFT reloads tied copies as one tensor; so does the loader
    assert len({id(t) for t in adapter.saved_modules.values()}) == distinct


def test_what_peft_saves(made):
    """Key names and shapes come from PEFT itself: the module's own state dict under the base
    model's name, no modules_to_save infix, no copy of the original module."""
    def vocab_keys(name):
        return {k: list(v.shape) for k, v in files(made, name)[1].items() if "layers" not in k}

    assert vocab_keys("both") == {f"{EMBED}.weight": [128, 64], f"{HEAD}.weight": [128, 64]}
    assert vocab_keys("head-targeted-and-saved") == {f"{HEAD}.weight": [128, 64]}
    assert vocab_keys("embed-lora-saved-head") == {
        f"{HEAD}.weight": [128, 64], f"{EMBED}.base_layer.weight": [128, 64],
        f"{EMBED}.lora_embedding_A": [4, 128], f"{EMBED}.lora_embedding_B": [64, 4]}
    assert vocab_keys("tied-weight-tying") == {f"{EMBED}.weight": [128, 64],
                                               f"{HEAD}.weight": [128, 64]}
    config = parse_adapter_config(files(made, "tied-weight-tying")[0])
    assert config.modules_to_save == ("embed_tokens",)  # PEFT wrote both spellings of it
    assert parse_adapter_config(files(made, "both")[0]).modules_to_save == ("embed_tokens", "lm_head")


def test_off_without_full_module_slots(made):
    for name in VARIANTS:
        with pytest.raises(AdapterError, match=FLAG) as refused:
            read_adapter(made[name][0], spec_for(VARIANTS[name][0], slots=0))
        assert refused.value.status == 422 and "modules_to_save is [" in str(refused.value)


def _load_edited(made, name: str, edit=None, config_changes: dict | None = None, spec=None):
    return load_edited(made[name][0], spec or made[name][3], edit, config_changes)


@pytest.mark.parametrize(
    ("name", "edit", "config_changes", "message"),
    [
        ("head", lambda t: t.update({f"{HEAD}.weight": torch.zeros(136, 64)}), None,
         r"\[136, 64\], but the base model's lm_head is \[128, 64\]; an adapter trained with a"
         r" resized vocabulary \(new tokens\) is not supported"),
        ("embed", lambda t: t.update({f"{EMBED}.weight": torch.zeros(120, 64)}), None,
         "resized vocabulary"),
        ("head", lambda t: t.update({f"{HEAD}.weight": torch.zeros(128, 32)}), None,
         "trained for a different base model"),
        ("head", lambda t: t.update({f"{HEAD}.weight": torch.zeros(128, 64, dtype=torch.int32)}),
         None, "has dtype I32"),
        ("head", lambda t: t[f"{HEAD}.weight"].__setitem__((3, 3), float("nan")), None,
         "NaN or infinite"),
        ("head", None, {"modules_to_save": None},
         "is a full copy of lm_head, which adapter_config.json does not list in modules_to_save"),
        ("head", lambda t: t.pop(f"{HEAD}.weight"), None,
         "lists lm_head in modules_to_save but the file holds no lm_head weight"),
        ("embed", lambda t: t.update({"base_model.model.embed_tokens.weight": torch.zeros(128, 64)}),
         None, "duplicates"),
        ("head", lambda t: t.update({f"{HEAD}.lora_A.weight": torch.zeros(4, 64),
                                     f"{HEAD}.lora_B.weight": torch.zeros(128, 4)}),
         {"target_modules": ["q_proj", "lm_head"]},
         "both a LoRA on lm_head .* and a full saved copy of it"),
        ("tied-weight-tying", lambda t: t[f"{HEAD}.weight"].add_(1.0), None,
         "saved lm_head must equal its saved embed_tokens"),
        ("tied-weight-tying", lambda t: t.pop(f"{HEAD}.weight"), None,
         "holds no lm_head weight \\(ensure_weight_tying"),
        ("tied-weight-tying", None, {"modules_to_save": ["lm_head"]},
         "lists only lm_head in modules_to_save"),
    ],
)
def test_malformed_saved_modules_are_refused(made, name, edit, config_changes, message):
    with pytest.raises(AdapterError, match=message):
        _load_edited(made, name, edit, config_changes)


@pytest.mark.parametrize("entry", ["norm", "score", "classifier", "model.norm", "head",
                                   "layers.0.mlp", ""])
def test_other_modules_to_save_are_refused(made, entry):
    with pytest.raises(AdapterError, match="serves saved copies of embed_tokens and lm_head only"):
        _load_edited(made, "head", config_changes={"modules_to_save": ["lm_head", entry]})


def test_modules_to_save_must_be_a_list(made):
    with pytest.raises(AdapterError, match="modules_to_save must be a list of module names"):
        _load_edited(made, "head", config_changes={"modules_to_save": "lm_head"})


def test_base_without_vocab_size_refuses_saved_modules(made):
    spec = without_vocabulary(adapter_spec(TINY, max_lora_rank=16, max_full_module_slots=1))
    with pytest.raises(AdapterError, match="gives no vocab_size"):
        read_adapter(made["head"][0], spec)


def test_unlisted_resized_vocabulary_copies_stay_refused(made):
    """PEFT saves embed_tokens.weight / lm_head.weight for every adapter of a resized model."""
    grown = lambda t: t.update({f"{EMBED}.weight": torch.zeros(136, 64),  # noqa: E731
                                f"{HEAD}.weight": torch.zeros(136, 64)})
    with pytest.raises(AdapterError, match="does not list in modules_to_save"):
        _load_edited(made, "head", grown, {"modules_to_save": None})
