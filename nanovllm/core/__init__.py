"""The control plane: which sequences run each step (scheduler.py), their KV-cache blocks
(block_manager.py), and when each ends (sequence.py). Pure Python on ints and lists; it never
imports torch (tests/test_contracts.py)."""
