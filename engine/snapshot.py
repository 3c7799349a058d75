"""What the engine looks like at one instant between steps: the one reading of its state that
metrics, the adapter listings and the fleet's heartbeat share. `take_snapshot(engine)` runs on
the engine's own thread or process, between steps, so nothing in it is torn mid-step. And
`EngineInfo`: what a server needs to know of an engine that does not change while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loragw.adapters.types import BaseModelSpec
from loragw.engine.lora.state import (
    LoadTimes,  # a field msgspec rebuilds across the process boundary
)
from loragw.engine.request.checks import RequestLimits

if TYPE_CHECKING:
    from loragw.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineInfo:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    limits: RequestLimits  # what a server checks a request against before sending it
    adapter_spec: BaseModelSpec  # what the base offers adapters: each is checked against it
    # the base's parameters, and of them what one token multiplies by (MoE: top_k of E
    # experts per sparse layer; dense: all); defaults for EngineInfos built without a model
    total_parameters: int = 0
    active_parameters: int = 0
    # bytes of the base's weights one rank holds, as stored (quantized bases: packed), and the
    # checkpoint's quantization ("none" for a floating-point base)
    weight_bytes: int = 0
    quantization: str = "none"


def engine_info(engine: LLMEngine) -> EngineInfo:
    import torch

    from loragw.engine.models import model_class

    args = engine.config.args
    with torch.device("meta"):  # the whole model, not this rank's part under TP; no memory
        total, active = model_class(args)(args).parameter_counts()
    quant = engine.config.quant
    return EngineInfo(engine.vocab_size, engine.config.max_model_len, engine.config.block_size,
                      engine.block_manager.num_blocks, engine.limits, engine.lora.spec,
                      total, active,
                      engine.model_runner.model.weight_bytes(),
                      "none" if quant is None else quant.describe())


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    slots_total: int
    slots_in_use: int  # slots a running sequence holds
    free_slots: int  # slots holding no adapter (a load there evicts nothing)
    residency: dict[str, str]  # registered adapter -> "device" | "host" | "disk"
    pinned: frozenset[str]  # adapters that are never evicted
    preemptions: int
    step_errors: int = 0  # engine steps that failed (their requests were failed, not the server)
    # adapter events per tier, as the engine counts them
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Device bytes of the adapter pools: projections, embed_tokens, lm_head, full_modules
    lora_device_bytes: dict[str, int] = field(default_factory=dict)
    # Speculative decoding per adapter ("" for the base): verifications, drafted tokens, and of
    # those the ones kept (vLLM's spec_decode counters); empty without --speculative-config
    spec_drafts: dict[str, int] = field(default_factory=dict)
    spec_draft_tokens: dict[str, int] = field(default_factory=dict)
    spec_accepted_tokens: dict[str, int] = field(default_factory=dict)
    # decoding rows a draft length was chosen for, and the lengths summed (engine/spec/goodput.py)
    spec_choices: dict[str, int] = field(default_factory=dict)
    spec_chosen_tokens: dict[str, int] = field(default_factory=dict)
    # Seconds of the engine's loads per tier ("device": slot fills, "host": re-reads)
    load_seconds: dict[str, LoadTimes] = field(default_factory=dict)
    # Adapter ids of the running and of the waiting sequences, each from its own queue, each
    # id once in queue order (what vLLM's lora_requests_info names; the base is left out)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def resident(self) -> list[str]:
        """Adapters in a device slot, by name."""
        return sorted(name for name, tier in self.residency.items() if tier == "device")


def take_snapshot(engine: LLMEngine, step_errors: int = 0) -> EngineSnapshot:
    """Runs on the engine thread, between steps."""
    lora, stats, blocks = engine.lora, engine.lora.stats, engine.block_manager
    return EngineSnapshot(
        num_running=engine.num_running, num_waiting=engine.num_waiting,
        kv_blocks_total=blocks.num_blocks, kv_blocks_free=blocks.num_free_blocks,
        slots_total=len(lora.slots), slots_in_use=lora.slots_in_use, free_slots=lora.free_slots,
        residency={name: lora.residency(name) for name in lora.adapters},
        pinned=frozenset(name for name, entry in lora.adapters.items() if entry.pinned),
        preemptions=engine.scheduler.num_preemptions, step_errors=step_errors,
        loads={"device": stats.device_loads, "host": stats.host_loads},
        evictions={"device": stats.device_evictions, "host": stats.host_evictions},
        hits={"device": stats.device_hits},
        prefix_cache_queries=blocks.cache.stats.queries,
        prefix_cache_hits=blocks.cache.stats.hits,
        lora_device_bytes=dict(lora.device_bytes),
        load_seconds={"device": stats.device_load_times.copy(),
                      "host": stats.host_load_times.copy()},
        running_adapters=_adapters(engine.scheduler.running),
        waiting_adapters=_adapters(engine.scheduler.waiting),
        **_spec_counters(engine))


def _adapters(queue) -> tuple[str, ...]:
    return tuple(dict.fromkeys(seq.adapter for seq in queue if seq.adapter is not None))


def _spec_counters(engine: LLMEngine) -> dict[str, dict[str, int]]:
    counts = engine.speculator.counts if engine.speculator is not None else {}
    return {f"spec_{name}": {adapter or "": getattr(c, name) for adapter, c in counts.items()}
            for name in ("drafts", "draft_tokens", "accepted_tokens", "choices", "chosen_tokens")}
