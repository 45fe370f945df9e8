"""The scheduler's side of LoRA (pure Python): a request under an adapter is admitted only while
its adapter has a slot, that is while the running requests' adapters are fewer than max_loras or
include its own; otherwise it waits at the head of the queue (core/scheduler.py's Admission)."""

from collections.abc import Iterable

from nanovllm.core.sequence import Sequence


class AdapterSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras

    def admits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        if not seq.lora_int_id:
            return True
        active = {s.lora_int_id for s in running} - {0}
        return seq.lora_int_id in active or len(active) < self.max_loras
