"""Distil drafters for the speculative-decoding bench (benchmarks/bench_spec.py): a 2-layer draft
model trained on its target's greedy outputs, and for each adapter a draft LoRA trained on that
adapter's outputs, as a deployment would distil a small drafter from the model it serves.

    python benchmarks/train_drafter.py --model M --out DIR [--adapters A ...] [--steps 300]

The draft starts as the target's first 2 of 8 layers with its embeddings, norm and head (what
bench_spec's untrained "draft" rows use) and is trained, every weight, to predict the token the
target chose at each position of 96 target continuations (16 random tokens, then 256 greedy
tokens; prompts drawn from another seed than the bench's). A draft LoRA (rank 16, the adapter's
own projections) starts from the adapter's layers 0-1 and is trained on the trained draft the
same way, on 32 continuations of the target with that adapter. Hard labels: greedy speculation
keeps a draft token only when it is the target's argmax. CPU, float32, a few minutes each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from common import layer_of  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger(__name__)
PROMPT, ANSWER = 16, 256  # tokens of each training sequence
DRAFT_LAYERS = 2


def continuations(model: str, adapters: list[str | None], per_adapter: int,
                  seed: int = 1) -> dict[str | None, torch.Tensor]:
    """{adapter path or None: [per_adapter, PROMPT + ANSWER] token ids}: random prompts and
    the target's greedy continuations, every adapter's in one engine run."""
    g = torch.Generator().manual_seed(seed)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(10, vocab, (PROMPT,), generator=g).tolist()
               for _ in range(per_adapter * len(adapters))]
    names = [None if a is None else f"a{i}" for i, a in enumerate(adapters)
             for _ in range(per_adapter)]
    real = [a for a in adapters if a is not None]
    with LLM(model, max_model_len=PROMPT + ANSWER + 16, max_loras=max(len(real), 1)) as llm:
        for i, path in enumerate(adapters):
            if path is not None:
                llm.add_adapter(f"a{i}", path)
        outs = llm.generate(prompts, SamplingParams(max_tokens=ANSWER, temperature=0.0,
                                                    ignore_eos=True), names)
    rows = torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)])
    return {a: rows[i * per_adapter:(i + 1) * per_adapter] for i, a in enumerate(adapters)}


def train(model: torch.nn.Module, data: torch.Tensor, steps: int, lr: float, batch: int,
          seed: int = 0) -> list[float]:
    """Steps of AdamW on the next-token loss over the answers' positions (the target's choices:
    the last prompt position onward). Returns the loss every 25 steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for step in range(steps):
        ids = data[torch.randint(0, len(data), (batch,), generator=g)]
        logits = model(input_ids=ids[:, :-1]).logits[:, PROMPT - 1:]  # [B, ANSWER, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, PROMPT:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            losses.append(round(loss.item(), 3))
            logger.info("step %d loss %.3f", step, loss.item())
    model.eval()
    return losses


@torch.no_grad()
def agreement(model: torch.nn.Module, data: torch.Tensor) -> float:
    """How often the draft's argmax is the target's token over the answers' positions."""
    logits = model(input_ids=data[:, :-1]).logits[:, PROMPT - 1:]
    return (logits.argmax(-1) == data[:, PROMPT:]).float().mean().item()


def distil_draft(model: str, draft: str, out: str, steps: int) -> dict:
    """The trained draft model saved into `out` (built once); returns its training record."""
    from transformers import LlamaForCausalLM

    record = Path(out, "distil.json")
    if record.is_file():
        return json.loads(record.read_text())
    data = continuations(model, [None], 96 + 8)[None]
    train_rows, held_out = data[:96], data[96:]
    torch.manual_seed(0)
    net = LlamaForCausalLM.from_pretrained(draft, dtype=torch.float32)
    before = agreement(net, held_out)
    losses = train(net, train_rows, steps, lr=1e-3, batch=8)
    info = {"steps": steps, "losses": losses, "agreement_before": before,
            "agreement_after": agreement(net, held_out)}
    net.save_pretrained(out)
    record.write_text(json.dumps(info))
    return info


def distil_drafters(model: str, draft: str, adapters: list[str], out_root: str,
                    steps: int) -> tuple[dict[str, str], dict]:
    """({"a<i>": draft LoRA dir}, records) for each adapter, trained on the trained draft."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    out, records = {}, {}
    todo = [(i, a) for i, a in enumerate(adapters)
            if not Path(out_root, f"drafter{i:02d}", "distil.json").is_file()]
    data = continuations(model, [a for _, a in todo], 32 + 4) if todo else {}
    for i, path in enumerate(adapters):
        target = Path(out_root, f"drafter{i:02d}")
        out[f"a{i}"] = str(target)
        if (target / "distil.json").is_file():
            records[f"a{i}"] = json.loads((target / "distil.json").read_text())
            continue
        config = json.loads(Path(path, "adapter_config.json").read_text())
        lora = LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                          target_modules=config["target_modules"],
                          layers_to_transform=list(range(DRAFT_LAYERS)))
        torch.manual_seed(0)
        net = get_peft_model(LlamaForCausalLM.from_pretrained(draft, dtype=torch.float32), lora)
        own = {k: v for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items()
               if layer_of(k) < DRAFT_LAYERS}
        set_peft_model_state_dict(net, own)  # start from the adapter's own first layers
        rows, held_out = data[path][:32], data[path][32:]
        before = agreement(net, held_out)
        losses = train(net, rows, steps, lr=2e-3, batch=4)
        records[f"a{i}"] = {"steps": steps, "losses": losses, "agreement_before": before,
                            "agreement_after": agreement(net, held_out)}
        net.save_pretrained(target)
        (target / "distil.json").write_text(json.dumps(records[f"a{i}"]))
    return out, records


def main() -> None:
    from benchmarks.bench_spec import build_draft

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapters", nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--adapter-steps", type=int, default=40)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    draft = build_draft(args.model, os.path.join(args.out, "draft2"), DRAFT_LAYERS)
    trained = os.path.join(args.out, "draft2-trained")
    print("draft", distil_draft(args.model, draft, trained, args.steps), flush=True)
    if args.adapters:
        _, records = distil_drafters(args.model, trained, args.adapters,
                                     os.path.join(args.out, "drafters"), args.adapter_steps)
        for name, record in records.items():
            print(name, record, flush=True)


if __name__ == "__main__":
    main()
