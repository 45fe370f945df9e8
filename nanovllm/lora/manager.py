"""The runner's adapters (one LoRAManager per rank, made with `enable_lora=True`): the model's
target projections made LoRA layers, the adapters read from disk, and `max_loras` slots in
which the adapters a step needs sit, the least recently used given up first.

    add(request)         every rank reads and checks the checkpoint (its own shard is loaded
                         into a slot when a step needs it)
    schedule(seqs)       rank 0: the slot loads the step needs (sent to every rank:
                         load_slots) and the rows' mapping
"""

from collections import OrderedDict

from torch import nn

from nanovllm.core.sequence import Sequence
from nanovllm.layers.linear import LinearBase
from nanovllm.lora.checkpoint import LoRAWeights, read_adapter
from nanovllm.lora.layers import LoRALayer
from nanovllm.lora.mapping import LoRAMapping, map_rows
from nanovllm.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int):
        self.max_rank = max_lora_rank
        # checkpoint module (q_proj) -> (our layer, its slice): the loader's mapping
        packed = getattr(model, "packed_modules_mapping", {})
        self.slice_of = {name: (layer, _slice(shard)) for name, (layer, shard) in packed.items()}
        self.layers: dict[str, LoRALayer] = {}  # our module name -> its LoRA layer
        for name, module in model.named_modules():
            target = name.rsplit(".", 1)[-1] in {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
            if target and isinstance(module, LinearBase):
                self.layers[name] = LoRALayer(module, max_loras, max_lora_rank)
                module.set_weight_format(self.layers[name])
        self.requests: dict[int, LoRARequest] = {}  # lora_int_id -> its adapter's request
        # lora_int_id -> our module name -> its slices' weights (None: not targeted), whole
        self.weights: dict[int, dict[str, list[LoRAWeights | None]]] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.free_slots = list(range(max_loras))

    # -- adapters ---------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Read and check an adapter; False if it is known already (by id, same name and path).
        A ValueError names what is wrong; nothing is kept then."""
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                    f"({known.lora_path}); give another adapter another id"
                )
            return False
        adapter = read_adapter(request, self.max_rank)
        placed = {name: [None] * len(layer.slice_sizes) for name, layer in self.layers.items()}
        for module, weights in adapter.weights.items():
            name, j = self._target(module, request.lora_name)
            self.layers[name].check(j, weights, f"LoRA adapter {request.lora_name!r}, {module}")
            placed[name][j] = weights
        self.requests[request.lora_int_id], self.weights[request.lora_int_id] = request, placed
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot freed); False if it is unknown."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        del self.weights[lora_int_id]
        if (slot := self.resident.pop(lora_int_id, None)) is not None:
            self.free_slots.append(slot)
        return True

    def lora_ids(self) -> set[int]:
        return set(self.requests)

    def _target(self, module: str, adapter: str) -> tuple[str, int]:
        """Our layer's name and slice for a checkpoint module (model.layers.3.self_attn.q_proj)."""
        parent, _, leaf = module.rpartition(".")
        ours, j = self.slice_of.get(leaf, (leaf, 0))
        name = f"{parent}.{ours}"
        if name not in self.layers:
            raise ValueError(f"LoRA adapter {adapter!r} targets {module}, which this model lacks")
        return name, j

    # -- slots ------------------------------------------------------------------------------

    def schedule(self, seqs: list[Sequence]) -> tuple[list[tuple[int, int]], LoRAMapping | None]:
        """Rank 0: the (slot, lora_int_id) loads that bring this step's adapters in, and the
        mapping of its rows (a sequence's num_scheduled_tokens rows, in batch order)."""
        needed = {seq.lora_int_id for seq in seqs} - {0}
        loads = []
        for lora_int_id in sorted(needed):
            if lora_int_id in self.resident:
                self.resident.move_to_end(lora_int_id)
            else:
                slot = self._free_slot(needed)
                self.resident[lora_int_id] = slot
                loads.append((slot, lora_int_id))
        row_slots = []
        for seq in seqs:
            slot = self.resident[seq.lora_int_id] if seq.lora_int_id else -1
            row_slots += [slot] * seq.num_scheduled_tokens
        return loads, map_rows(row_slots)

    def _free_slot(self, needed: set[int]) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        for lora_int_id in self.resident:  # least recently used first
            if lora_int_id not in needed:
                return self.resident.pop(lora_int_id)
        # The scheduler admits no more adapters than there are slots (scheduling.py).
        raise RuntimeError(f"a step needs more adapters than the {len(self.resident)} slots")

    def load_slots(self, loads: list[tuple[int, int]]) -> None:
        """Every rank: the adapters' weights into their slots, layer by layer."""
        for slot, lora_int_id in loads:
            for name, slices in self.weights[lora_int_id].items():
                self.layers[name].load(slot, slices)


def _slice(shard: object) -> int:
    """A packed shard id (the loader's "q"/"k"/"v" or an index) as the slice's index."""
    return "qkv".index(shard) if isinstance(shard, str) else shard
