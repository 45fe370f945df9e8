"""The control plane: which sequences run each step, their KV-cache blocks, and when each
ends. Pure Python on ints and lists; it never imports torch (tests/test_contracts.py)."""

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
