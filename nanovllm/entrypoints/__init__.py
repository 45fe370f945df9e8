"""Online serving: `async_engine` runs an LLMEngine's step loop in a thread and streams
each request's output; `openai_server` puts OpenAI's HTTP API over it (FastAPI, the
`serve` extra); `cli` is `python -m nanovllm serve MODEL`."""
