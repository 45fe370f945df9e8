"""Which adapter each row of a step runs under: built by the runner's LoRAManager on rank 0 from
the step's sequences, carried in the step's ForwardContext (`lora`) to every rank and read by
every LoRA layer of the forward. A row's slot is where its adapter's weights sit in each layer's
stacked buffers (lora/layers.py); -1 is the base model."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRAGroup:
    slot: int
    rows: torch.Tensor | None  # [n] int64: the rows under this slot; None: all of them


@dataclass(slots=True)
class LoRAMapping:
    slots: torch.Tensor  # [num_rows] int64, -1 = no adapter (what a Triton kernel reads)
    groups: list[LoRAGroup]  # the same, row indices per slot (what the grouped GEMMs read)


def map_rows(row_slots: list[int]) -> LoRAMapping | None:
    """The mapping of rows whose slots are `row_slots`; None when no row has an adapter."""
    distinct = sorted(set(row_slots) - {-1})
    if not distinct:
        return None
    slots = torch.tensor(row_slots, dtype=torch.int64)
    if len(distinct) == 1 and -1 not in row_slots:
        return LoRAMapping(slots, [LoRAGroup(distinct[0], None)])
    groups = [LoRAGroup(slot, torch.nonzero(slots == slot).flatten()) for slot in distinct]
    return LoRAMapping(slots, groups)
