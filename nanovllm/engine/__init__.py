"""The engine: LLMEngine's step loop (llm_engine.py; the overlapped one for async scheduling in
overlap.py), the detokenizer and stop strings, and the asyncio front the server uses."""

from nanovllm.engine.llm_engine import EngineStats, LLMEngine, NewToken, Prompt, StepOutput

__all__ = ["EngineStats", "LLMEngine", "NewToken", "Prompt", "StepOutput"]
