"""How users reach the engine: the offline `LLM` (llm.py), OpenAI's HTTP API over the engine's
asyncio front (openai_server.py and protocol.py; FastAPI, the `serve` extra), and the command
line `nanovllm serve MODEL` (cli.py)."""
