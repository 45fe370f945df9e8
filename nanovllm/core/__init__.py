"""The CPU control plane: pure Python, never imports torch (DESIGN.md, layer L3)."""

from nanovllm.core.block_manager import Block, BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import PENDING, FinishReason, Sequence, SequenceStatus

__all__ = [
    "Block",
    "BlockManager",
    "FinishReason",
    "PENDING",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
]
