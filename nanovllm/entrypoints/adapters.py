"""LoRA adapters on the server (`nanovllm serve MODEL --enable-lora --lora-modules name=path`),
as vLLM serves them: a request's `model` names the base model or one of the adapters, and
`/v1/models` lists them all, each adapter with its path (`root`) and the base (`parent`).

    --lora-modules sql=/ckpt/sql-lora '{"name": "chat", "path": "/ckpt/chat-lora"}'

With VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the server's environment (vLLM's switch: loading
reads any path the server can), two more routes change them at run time:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/ckpt/sql-lora"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A bad adapter (no such files, a rank above --max-lora-rank, a module the model lacks) is a 400,
a name already loaded a 400, one unknown a 404, each with OpenAI's error body; an adapter is
read and loaded in the engine's thread, between two steps. Imported only with --enable-lora.
"""

import json
import os

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.entrypoints.protocol import ModelNotFound
from nanovllm.lora.request import LoRARequest

RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, as
    (name, path); a ValueError says what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
        spec = spec if isinstance(spec, dict) else {}
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError('expected name=path or {"name": "...", "path": "..."}, both non-empty')
    return name, path


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING, "").strip().lower() in ("1", "true")


class ServedAdapters:
    """The adapters a server serves, by name; each gets the next lora_int_id."""

    def __init__(self, front: AsyncEngine, base_name: str):
        self.front, self.base_name = front, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self.next_id = 1

    def add_at_start(self, name: str, path: str) -> None:
        """An adapter of --lora-modules, before the engine's thread starts."""
        self._check_new(name)
        request = LoRARequest(name, self._new_id(), path)
        self.front.engine.add_lora(request)
        self.by_name[name] = request

    def resolve(self, model: object) -> int:
        """The lora_int_id a request's `model` asks for: 0 for the base model (or none given)."""
        if model is None or model == self.base_name:
            return 0
        request = self.by_name.get(model) if isinstance(model, str) else None
        if request is None:
            raise ModelNotFound(
                f"The model `{model}` does not exist; this server serves `{self.base_name}` and "
                f"the LoRA adapters {sorted(self.by_name) or 'none'}"
            )
        return request.lora_int_id

    def cards(self, created: int) -> list[dict]:
        """/v1/models' entries for the adapters (vLLM's: root the path, parent the base)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "nanovllm",
                "root": request.lora_path,
                "parent": self.base_name,
            }
            for name, request in self.by_name.items()
        ]

    async def load(self, body: dict) -> str:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        self._check_new(name)
        request = LoRARequest(name, self._new_id(), path)
        await self.front.call(self.front.engine.add_lora, request)  # a ValueError if it is bad
        if name in self.by_name:  # a load of the same name won meanwhile: this one goes
            await self.front.call(self.front.engine.remove_lora, request.lora_int_id)
            self._check_new(name)
        self.by_name[name] = request
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict) -> str:
        name = _field(body, "lora_name")
        request = self.by_name.get(name)
        if request is None:
            raise ModelNotFound(f"The LoRA adapter '{name}' cannot be found.", "lora_name")
        # Out of the names first: no new request takes it while its running ones are checked.
        del self.by_name[name]
        try:
            await self.front.call(self.front.engine.remove_lora, request.lora_int_id)
        except ValueError:  # requests still use it: it stays
            self.by_name[name] = request
            raise
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_new(self, name: str) -> None:
        if name == self.base_name or name in self.by_name:
            raise ValueError(f"The LoRA adapter '{name}' has already been loaded.")

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        raise ValueError(f"'{name}' is required")
    if not isinstance(value, str) or not value:
        raise TypeError(f"'{name}' must be a non-empty string, got {value!r}")
    return value
