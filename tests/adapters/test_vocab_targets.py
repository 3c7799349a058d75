"""LoRA on embed_tokens and lm_head: PEFT-made adapters load exactly as PEFT reloads them, the
base-weight copies PEFT saves beside them are checked and dropped, and malformed ones are
refused naming what is wrong."""

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
    without_vocabulary,
)

from loragw.adapters.errors import AdapterError
from loragw.adapters.format import read_adapter
from loragw.adapters.lora_config import parse_adapter_config
from loragw.engine.models import adapter_spec

# name -> (tie_word_embeddings, peft LoraConfig kwargs)
VARIANTS = {
    "vocab": (False, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"],
                          rank_pattern={"lm_head": 2}, alpha_pattern={"embed_tokens": 2})),
    "tied-own-head": (True, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"])),
    "tied-weight-tying": (True, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"],
                                     ensure_weight_tying=True)),
}  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each VARIANT saved by PEFT, and what PeftModel.from_pretrained reloads from it."""
    out = {}
    for name, saved_by_peft in save_with_peft(VARIANTS, tmp_path_factory).items():
        expected = {module_key(n): (a.detach().clone(), b.detach().clone(), m.scaling["default"])
                    for n, a, b, m in lora_weights(saved_by_peft.reloaded)}
        spec = adapter_spec(saved_by_peft.base_config, max_lora_rank=16)
        out[name] = (saved_by_peft.path, expected, spec)
    return out


def files(made, name: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    return saved_files(made[name][0])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_load_matches_peft(made, name):
    path, expected, spec = made[name]
    adapter = read_adapter(path, spec)
    assert sorted(adapter.modules, key=str) == sorted(expected, key=str)
    for key, (a, b, scaling) in expected.items():
        m = adapter.modules[key]
        assert (m.layer, m.target) == key
        torch.testing.assert_close(m.lora_a, a, rtol=0, atol=0)
        torch.testing.assert_close(m.lora_b, b, rtol=0, atol=0)
        assert m.scaling == pytest.approx(scaling, rel=1e-12)


def test_what_peft_saves_for_vocabulary_targets(made):
    """Key names and shapes come from PEFT itself (not guessed); base copies are dropped."""
    _, tensors = files(made, "vocab")
    shapes = {k: list(v.shape) for k, v in tensors.items() if "layers" not in k}
    assert shapes == {f"{EMBED}.lora_embedding_A": [4, 128], f"{EMBED}.lora_embedding_B": [64, 4],
                      f"{EMBED}.base_layer.weight": [128, 64], f"{HEAD}.lora_A.weight": [2, 64],
                      f"{HEAD}.lora_B.weight": [128, 2], f"{HEAD}.base_layer.weight": [128, 64]}
    adapter = read_adapter(made["vocab"][0], made["vocab"][2])
    assert adapter.targets == ("embed_tokens", "lm_head", "q_proj")
    assert adapter.modules[(None, "embed_tokens")].scaling == 2 / 4  # alpha_pattern
    assert adapter.modules[(None, "lm_head")].rank == 2  # rank_pattern


def _load_edited(made, name: str, edit, config_changes: dict | None = None, spec=None):
    return load_edited(made[name][0], spec or made[name][2], edit, config_changes)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({f"{EMBED}.lora_embedding_A": torch.zeros(4, 100)}),
         r"lora_embedding_A \[4, 100\] and lora_embedding_B \[64, 4\]; the base model needs"
         r" lora_embedding_A \[r, 128\] and lora_embedding_B \[64, r\]"),
        (lambda t: t.update({f"{EMBED}.lora_embedding_B": torch.zeros(32, 4)}),
         r"lora_embedding_B \[32, 4\]"),
        (lambda t: t.update({f"{HEAD}.lora_B.weight": torch.zeros(100, 2)}),
         r"'lm_head' has lora_A \[2, 64\] and lora_B \[100, 2\]; the base model needs lora_A"
         r" \[r, 64\] and lora_B \[128, r\]"),
        (lambda t: t.update({f"{HEAD}.lora_A.weight": torch.zeros(2, 32)}), r"lora_A \[2, 32\]"),
        (lambda t: t.update({f"{EMBED}.lora_embedding_A": torch.zeros(3, 128),
                             f"{EMBED}.lora_embedding_B": torch.zeros(64, 3)}),
         "'model.embed_tokens' has rank 3 but adapter_config.json says 4"),
        (lambda t: t.update({f"{EMBED}.base_layer.weight": torch.zeros(130, 64)}),
         r"is F32\[130, 64\], but the base model's embed_tokens weight is \[128, 64\]; an adapter"
         " trained with a resized vocabulary"),
        (lambda t: t.update({f"{HEAD}.base_layer.weight": torch.zeros(128, 64, dtype=torch.int32)}),
         r"is I32\[128, 64\]"),
        (lambda t: t.pop(f"{EMBED}.lora_embedding_B"), "'model.embed_tokens' has no lora_B"),
        (lambda t: t.update({f"{EMBED}.lora_embedding_A.default":
                             t[f"{EMBED}.lora_embedding_A"].clone()}),
         "duplicates the lora_A of embed_tokens"),
        (lambda t: t.update({"base_model.model.model.layers.0.embed_tokens.lora_embedding_A":
                             torch.zeros(4, 128)}), "embedding LoRA at an unexpected path"),
        (lambda t: t.update({"base_model.model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}),
         "puts lm_head at an unexpected path"),
        (lambda t: t.update({f"{HEAD}.lora_A.weight": t[f"{HEAD}.lora_A.weight"].half()}), None),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_vocabulary_loras_are_refused(made, edit, message):
    if message is None:  # half precision is fine: becomes float32
        assert _load_edited(made, "vocab", edit).modules[(None, "lm_head")].lora_a.dtype == torch.float32
        return
    with pytest.raises(AdapterError, match=message):
        _load_edited(made, "vocab", edit)


def test_targets_follow_peft_layers_to_transform_rules(made):
    """PEFT: a target named in full skips the layer filter; a suffix match needs a layer index
    (embed_tokens, lm_head have none)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    for targets in (["embed_tokens", "lm_head", "q_proj"], ["model.embed_tokens", "lm_head"]):
        fields = dict(r=2, lora_alpha=4, target_modules=targets, layers_to_transform=[1])
        ours = parse_adapter_config({"peft_type": "LORA", **fields})
        peft = LoraConfig(**fields)
        for name, layer in (("model.embed_tokens", None), ("lm_head", None),
                            ("model.layers.1.self_attn.q_proj", 1),
                            ("model.layers.0.self_attn.q_proj", 0)):
            assert ours.targets_module(name, layer) == bool(check_target_module_exists(peft, name))
    with pytest.raises(AdapterError, match="does not target"):
        _load_edited(made, "vocab", lambda t: None, {"layers_to_transform": [0, 1]})


def test_tied_base_lm_head_lora_is_its_own_unless_weight_tying(made):
    untied_spec = made["vocab"][2]
    tied = made["tied-own-head"]
    assert tied[2].tie_word_embeddings
    # without ensure_weight_tying the two LoRAs are independent, tied base or not
    assert read_adapter(tied[0], untied_spec).modules.keys() == tied[1].keys()
    # ensure_weight_tying: lm_head's saved LoRA is the embedding LoRA transposed
    adapter = read_adapter(made["tied-weight-tying"][0], made["tied-weight-tying"][2])
    embed, head = adapter.modules[(None, "embed_tokens")], adapter.modules[(None, "lm_head")]
    assert torch.equal(head.lora_a, embed.lora_b.T) and torch.equal(head.lora_b, embed.lora_a.T)


def test_broken_weight_tying_is_refused(made):
    def poke(t):
        t[f"{HEAD}.lora_A.weight"] = t[f"{HEAD}.lora_A.weight"] + 1

    with pytest.raises(AdapterError, match="lm_head LoRA must be its embed_tokens LoRA transposed"):
        _load_edited(made, "tied-weight-tying", poke)
    with pytest.raises(AdapterError, match="the file holds only one of them"):
        _load_edited(made, "tied-weight-tying",
                     lambda t: [t.pop(f"{HEAD}.lora_{ab}.weight") for ab in "AB"])
    with pytest.raises(AdapterError, match="'lm_head', which adapter_config.json does not target"):
        _load_edited(made, "tied-weight-tying", lambda t: None, spec=made["vocab"][2])  # untied


def test_base_without_vocab_size_refuses_vocabulary_loras(made):
    no_vocab = without_vocabulary(adapter_spec(TINY, 16))
    with pytest.raises(AdapterError, match="gives no vocab_size"):
        read_adapter(made["vocab"][0], no_vocab)
