"""PEFT (and transformers) as the reference for the engine's parity tests: a tiny random Llama,
adapters made and saved by PEFT itself, PEFT's greedy tokens per request (float32, CPU), its
logits over given tokens in any dtype (`World.peft_logits`), and `World`, which puts them
together for a test module.

Heavy imports (transformers, peft, the engine) stay inside the functions.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from loragw.engine import LLM

MAX_TOKENS = 10
VOCAB, HIDDEN = 256, 64  # the base's vocabulary and hidden size (build_base)
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Prompt lengths, one per request of a World, in order.
LENGTHS = (5, 1, 17, 9, 23, 3, 12, 7, 14, 2, 19, 6, 11, 8, 4, 10, 13, 16, 3)


def build_base(path: str, tie_word_embeddings: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=None, eos_token_id=None)  # no EOS: every token counts
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)  # diverse greedy outputs
    model.save_pretrained(path)
    return path


def save_peft_adapters(base: str, out_dir: str, specs: dict[str, dict], seed: int) -> dict[str, str]:
    """PEFT-made adapters with N(0, 0.3) LoRA weights and saved modules (modules_to_save) moved
    off the base by N(0, 0.1) noise, so they change outputs; name -> dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not specs:
        return {}
    torch.manual_seed(seed)
    model = None
    for name, spec in specs.items():
        config = LoraConfig(**spec, init_lora_weights=False)
        if model is None:
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config, name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.normal_(0, 0.3)
            elif ".modules_to_save." in param_name:
                p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(out_dir)  # adapter `name` lands in out_dir/name
    return {name: os.path.join(out_dir, name) for name in specs}


@contextmanager
def active(model, adapter: str | None):
    """`model` (a PeftModel) answering as `adapter`, or as the base model (None)."""
    if adapter is None:
        with model.disable_adapter():
            yield model
    else:
        model.set_adapter(adapter)
        yield model


def peft_greedy(model, prompts: list[list[int]], adapters: list[str | None],
                max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outputs = []
    for prompt, adapter in zip(prompts, adapters, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: without one, generate masks every prompt token equal to pad_token_id.
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, pad_token_id=0)
        with active(model, adapter):
            out = model.generate(input_ids=ids, **kwargs)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def peft_forced_logits(model, prompt: list[int], tokens: list[int],
                       adapter: str | None) -> torch.Tensor:
    """PEFT's logits behind each of `tokens` after `prompt`, from one forward over prompt +
    tokens (teacher forcing): [len(tokens), V] float32, row j the logits that predict tokens[j]."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with active(model, adapter):
        logits = model(input_ids=ids).logits[0]  # [P + N, V], the model's dtype
    return logits[len(prompt) - 1:-1].float()


def load_peft(base: str, dirs: dict[str, str], dtype: torch.dtype = torch.float32,
              device: str = "cpu"):
    """A PeftModel on `base` in `dtype` on `device` holding every adapter of `dirs` (name ->
    dir). PEFT's default autocast_adapter_dtype keeps LoRA weights float32 on a bf16 / fp16
    base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    hf.generation_config.eos_token_id = None  # every token counts, as under ignore_eos
    names = list(dirs)
    model = PeftModel.from_pretrained(hf, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    return model.to(device).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt of the checkpoint at `path`, no adapter."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # No end-of-sequence tokens at all (the engine runs with ignore_eos): min_new_tokens would
    # instead forbid them, which is a different distribution.
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def needs_triton(options: dict) -> None:
    """Skip the test if engine `options` ask for the Triton backend and it cannot run here."""
    if options.get("lora_backend") == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1; "
                    "tests/kernels/test_kernels_gpu.py covers it on GPUs")


@dataclass(frozen=True)
class Retrained:
    """An adapter's config saved again with other weights: what replacing it must switch to."""

    path: str
    expected: list[list[int]]  # PEFT's tokens for World.rows(that adapter), in order


class World:
    """A base checkpoint, adapters saved by PEFT, mixed requests and PEFT's answers, built once.

    Every adapter has two requests and the base model three (`requests`, None for the base),
    with prompts of LENGTHS tokens (`prompts`); `expected` holds PEFT's greedy tokens for each
    request, `expected_base` the base model's for the same prompt. Building asserts that every
    adapter changes its outputs.

    By default one PEFT model saves all of `specs` (seed 1), and one PeftModel holding them all
    answers. Options:
      tied         the base ties lm_head to embed_tokens.
      first        adapters saved by a PEFT model of their own (seed 2), added to the engine
                   and loaded into the PeftModel before `specs`. PEFT ties an
                   ensure_weight_tying adapter's lm_head only while lm_head holds no other
                   adapter's LoRA yet: loaded after one, it gets no lm_head LoRA at all.
      apart        every adapter saved (seeds 1, 2, ... in order) and answered by a PEFT model
                   of its own, as from_pretrained serves it: PEFT cannot hold a LoRA on lm_head
                   beside another adapter's saved lm_head (modules_to_save).
      prompt_seed  the seed of the random prompts.
      base         another base checkpoint's directory to serve instead of build_base's
                   Llama (tests/checkpoints.py: Phi-3, an MoE); its vocabulary must hold VOCAB.
    """

    def __init__(self, root: str, specs: dict[str, dict], *, tied: bool = False,
                 first: dict[str, dict] | None = None, apart: bool = False,
                 prompt_seed: int = 7, base: str | None = None):
        first = first or {}
        assert not (first and apart), "apart saves every adapter alone already: no `first`"
        self.root = root
        self.base = base or build_base(os.path.join(root, "base"), tie_word_embeddings=tied)
        self.specs = first | specs
        if apart:
            self.dirs: dict[str, str] = {}
            for seed, (name, spec) in enumerate(self.specs.items(), start=1):
                self.dirs |= save_peft_adapters(self.base, os.path.join(root, name), {name: spec},
                                                seed)
        else:
            self.dirs = save_peft_adapters(self.base, os.path.join(root, "first"), first, 2)
            self.dirs |= save_peft_adapters(self.base, os.path.join(root, "adapters"), specs, 1)
        self.saved = [name for name, spec in self.specs.items() if spec.get("modules_to_save")]
        names = list(self.dirs)
        self.requests: list[str | None] = [*names, None, *reversed(names), None, None]
        assert len(self.requests) <= len(LENGTHS), f"{len(names)} adapters: add prompt lengths"
        g = torch.Generator().manual_seed(prompt_seed)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist()
                        for n in LENGTHS[:len(self.requests)]]
        # The dirs each answering PeftModel loads.
        self.oracles = ([{name: path} for name, path in self.dirs.items()] if apart
                        else [self.dirs])
        self._ask_peft()

    def _oracle_rows(self, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        """Each PeftModel of `oracles`, in `dtype`, with the requests it answers (indices); the
        base model's own requests go to the last one, its adapters disabled."""
        for k, dirs in enumerate(self.oracles):
            last = k == len(self.oracles) - 1
            yield load_peft(self.base, dirs, dtype, device), [
                i for i, a in enumerate(self.requests) if a in dirs or (last and a is None)]

    def _ask_peft(self) -> None:
        """`expected` and `expected_base`, from the PeftModels of `oracles`."""
        self.expected: list[list[int]] = [[] for _ in self.requests]
        self.expected_base: list[list[int]] = [[] for _ in self.requests]
        for oracle, rows in self._oracle_rows():
            prompts = [self.prompts[i] for i in rows]
            with torch.inference_mode():
                tokens = peft_greedy(oracle, prompts, [self.requests[i] for i in rows])
                base = peft_greedy(oracle, prompts, [None] * len(rows))
            for i, want, plain in zip(rows, tokens, base, strict=True):
                self.expected[i], self.expected_base[i] = want, plain
        for want, plain, adapter in zip(self.expected, self.expected_base, self.requests,
                                        strict=True):
            assert (want != plain) == (adapter is not None), f"adapter {adapter} changes nothing"

    def peft_logits(self, outputs: list[list[int]], dtype: torch.dtype,
                    device: str = "cpu") -> list[torch.Tensor]:
        """PEFT's logits behind every token of `outputs` (one token list per request, in
        request order) after that request's prompt, teacher-forced (peft_forced_logits) by the
        PeftModels of `oracles` in `dtype` on `device`: [len(outputs[i]), V] float32 per
        request, on the CPU."""
        logits: list[torch.Tensor] = [torch.empty(0)] * len(self.requests)
        assert len(outputs) == len(self.requests), "one output per request"
        for oracle, rows in self._oracle_rows(dtype, device):
            with torch.inference_mode():
                for i in rows:
                    logits[i] = peft_forced_logits(oracle, self.prompts[i], outputs[i],
                                                   self.requests[i]).cpu()
        return logits

    def rows(self, adapter: str | None) -> list[int]:
        """The indices of the requests for `adapter` (None: the base model's)."""
        return [i for i, a in enumerate(self.requests) if a == adapter]

    def retrain(self, name: str, seed: int) -> Retrained:
        """Adapter `name`'s config saved by PEFT again, with the weights of `seed`."""
        path = save_peft_adapters(self.base, os.path.join(self.root, "retrained"),
                                  {name: self.specs[name]}, seed)[name]
        oracle = load_peft(self.base, {name: path})
        rows = self.rows(name)
        with torch.inference_mode():
            expected = peft_greedy(oracle, [self.prompts[i] for i in rows], [name] * len(rows))
        return Retrained(path, expected)

    def llm(self, **options) -> LLM:
        """An engine on the base with every adapter added; `options` override its defaults."""
        from loragw.engine import LLM

        defaults = dict(device="cpu", dtype="float32", max_loras=len(self.dirs),
                        max_full_module_slots=len(self.saved), max_lora_rank=16,
                        lora_backend="torch")
        llm = LLM(self.base, **(defaults | options))
        for name, path in self.dirs.items():
            llm.add_adapter(name, path)
        return llm

    def check(self, outputs, label: str) -> None:
        """Every output has PEFT's tokens for its request (`outputs` in request order)."""
        for i, (out, want) in enumerate(zip(outputs, self.expected, strict=True)):
            assert out.token_ids == want, (
                f"{label}: request {i} (adapter {self.requests[i]}, prompt of "
                f"{len(self.prompts[i])} tokens) gave {out.token_ids}, PEFT {want}")
