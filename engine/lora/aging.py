"""Slot aging, the LoRA manager's answer to the scheduler's `drain_for` (engine/sched/scheduler.py):
which resident adapter stops admitting new sequences so that its slot drains for a request that
has waited too long for one.
"""

from __future__ import annotations

from loragw.engine.lora.state import RegisteredAdapter, Slot


def slot_to_drain(slots: list[Slot], adapters: dict[str, RegisteredAdapter], full,
                  starvation_steps: int | None, waited: int, adapter: str) -> str | None:
    """Once a request for `adapter` has waited `lora_starvation_steps` steps for a slot, the
    adapter whose slot should take no new sequences until it goes idle and changes hands: the
    unpinned slot with the fewest running sequences (the soonest idle), least recently used on
    ties; one that holds a full-module slot when `adapter` waits for one. None before then,
    when disabled, or while a replaced or removed adapter's slot is draining already. Never
    evicts: the slot's running sequences finish first. `full`: the full-module slots
    (engine/lora/full_modules.py)."""
    if starvation_steps is None or waited < starvation_steps:
        return None
    if any(slot.stale for slot in slots):
        return None
    entry = adapters.get(adapter)
    needs_full = entry is not None and bool(entry.saved_modules) and not full.has_free
    if not needs_full and any(slot.adapter is None for slot in slots):
        return None
    candidates = [s for i, s in enumerate(slots) if s.adapter is not None
                  and not adapters[s.adapter].pinned
                  and (not needs_full or full.holds(i))]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (s.ref_count, s.last_used)).adapter
