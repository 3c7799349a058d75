"""The engine's adapter calls: register, replace, move between tiers, pin and forget
adapters, and fail the requests whose adapter could not be read. A part of LLMEngine (a mixin
over its `lora` manager, `requests` and `abort`), apart so the step reads on its own."""

from __future__ import annotations

from loragw.adapters.format import LoraAdapter, read_adapter
from loragw.engine.spec.ngram import NO_DRAFT_MODEL


class AdapterCalls:
    def add_adapter(self, name: str, path: str | None, adapter: LoraAdapter | None = None,
                    catalog_version: int | None = None) -> int:
        """Register or replace an adapter (`adapter`, parsed and validated where its bytes were
        read, else read from the PEFT directory `path`, its disk copy too; None: in memory only);
        returns its engine version. `catalog_version`: the fleet's number for it, the one logs
        name. A bad adapter raises AdapterError, changing nothing."""
        if adapter is None:
            adapter = read_adapter(path, self.lora.spec)
        busy = {r.seq.adapter for r in self.requests.values() if r.seq.adapter}
        return self.lora.add(name, adapter, path=path, busy=busy, catalog_version=catalog_version)

    def add_draft_adapter(self, name: str, path: str) -> None:
        """Register (or replace) the draft-model LoRA that drafts for adapter `name`'s rows
        (speculative decoding with a draft model); AdapterError when it does not fit the draft."""
        if self.speculator is None:
            raise ValueError(NO_DRAFT_MODEL)
        self.speculator.proposer.add_adapter(name, path)

    def evict_adapter(self, name: str) -> bool:
        """Move an adapter down to the disk tier (device slot and host copy freed)."""
        return self.lora.evict(name)

    def to_device(self, name: str) -> str:
        """Bring a registered adapter into a device slot now; returns "device" or "host"."""
        return self.lora.to_device(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        self.lora.pin(name, pinned)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter; requests still using it are aborted and its slot freed."""
        self.lora.check_known(name)
        for request_id, request in list(self.requests.items()):
            if request.seq.adapter == name:
                self.abort(request_id)
        self.lora.remove(name)

    def take_failures(self) -> list[tuple[list[str], str]]:
        """[(ids, why)]: requests failed, after a step, as their adapter could not be re-read."""
        failures = []
        for adapter, why in self.lora.reads.take_failures().items():
            dropped = self.scheduler.drop_waiting(adapter)
            for seq in dropped:
                del self.requests[seq.request_id]
            failures.append(([seq.request_id for seq in dropped], why))
        return failures
