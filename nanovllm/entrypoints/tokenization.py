"""Prompts into token ids for the server, and vLLM's /tokenize and /detokenize. The work whose
time grows with a request's size (a chat template, the tokenizer, decoding) runs in the
AsyncEngine's tokenizer thread, never on the event loop nor in the engine's step thread.

A text prompt is first measured, in the time len() takes: more than

    max_model_len x (characters of the vocabulary's longest token)

characters cannot fit the context, since no token covers more text than that, so it is refused
before the tokenizer sees it (vLLM's bound, its tokenizer's max_chars_per_token). Without this a
12 MB prompt held the tokenizer for about a minute. (A normalizer that composes characters, as
NFC does, could in principle fit more characters into a token; vLLM takes the same bound.)
"""

import inspect
from typing import NamedTuple

from jinja2 import TemplateError

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.engine.llm_engine import check_token_ids
from nanovllm.entrypoints import protocol
from nanovllm.entrypoints.tools import ToolCalling
from nanovllm.utils import check_bool


class TokenizedPrompt(NamedTuple):
    text: str | None  # as sent or rendered; None for token ids
    token_ids: list[int]


class Tokenization:
    def __init__(self, front: AsyncEngine):
        self.front, self.tokenizer = front, front.tokenizer
        self.max_model_len = front.engine.config.max_model_len
        self.max_num_seqs = front.engine.config.max_num_seqs
        self.vocab_size = front.engine.config.hf_config.vocab_size
        longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_chars = self.max_model_len * longest_token
        # What chat_template_kwargs may not set: apply_chat_template's own parameters, and the
        # template's `messages`.
        signature = inspect.signature(self.tokenizer.apply_chat_template)
        named = (p.name for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD)
        self.reserved_template_kwargs = frozenset((*named, "messages"))

    # -- prompts of /v1/completions and /v1/chat/completions --------------------------------

    async def completion_prompts(self, body: dict, n: int) -> list[TokenizedPrompt]:
        """Each prompt of a completions request with its token ids (text as vLLM tokenizes it,
        special tokens added)."""
        prompts = protocol.completion_prompts(body.get("prompt"))
        many = len(prompts) > 1
        self.check_choices(len(prompts), n)
        for i, prompt in enumerate(prompts):
            self.check_length(f"prompt {i}" if many else "prompt", prompt)
        return await self.front.offload(self._encode_all, prompts, many)

    async def chat_prompt(
        self, body: dict, n: int = 1, add_special_tokens: bool = False
    ) -> TokenizedPrompt:
        """The conversation as the chat template renders it (with the request's
        chat_template_kwargs), and its token ids (the template holds the special tokens;
        add_special_tokens adds the tokenizer's as well)."""
        messages = protocol.chat_messages(body.get("messages"))
        self.check_choices(1, n)
        add_generation_prompt = body.get("add_generation_prompt", True)
        check_bool("add_generation_prompt", add_generation_prompt)
        variables = protocol.chat_template_kwargs(
            body.get("chat_template_kwargs"), self.reserved_template_kwargs
        )
        self.check_length("messages", "".join(m["content"] for m in messages))
        calling = ToolCalling.from_body(body)  # its tools rendered, unless tool_choice is "none"
        tools = None if calling is None else calling.tools
        return await self.front.offload(
            self._render, messages, add_generation_prompt, add_special_tokens, tools, variables
        )

    def check_choices(self, num_prompts: int, n: int) -> None:
        """One small request must not queue a flood of sequences: at most max_num_seqs (the
        most the engine runs at once) choices per request."""
        if num_prompts * n > self.max_num_seqs:
            raise ValueError(
                f"{'n' if num_prompts == 1 else 'prompt'}: {num_prompts:,} prompt(s) x n={n} "
                f"are more choices than max_num_seqs={self.max_num_seqs}, the most sequences "
                f"this server runs at once; send fewer in one request"
            )

    def check_length(self, name: str, prompt: str | list[int]) -> None:
        """Refuse a prompt that cannot fit the context, by its length alone."""
        if not isinstance(prompt, str):
            if len(prompt) > self.max_model_len:
                raise ValueError(
                    f"{name} of {len(prompt):,} tokens is longer than "
                    f"max_model_len={self.max_model_len}; shorten it"
                )
            return
        text = prompt
        if len(text) > self.max_chars:
            raise ValueError(
                f"{name}: {len(text):,} characters is more than the {self.max_chars:,} that "
                f"max_model_len={self.max_model_len} tokens can hold (no token of this "
                f"tokenizer is longer than {self.max_chars // self.max_model_len}); shorten it"
            )

    # -- in the tokenizer thread --------------------------------------------------------------

    def _encode_all(self, prompts: list[str | list[int]], many: bool) -> list[TokenizedPrompt]:
        return [
            TokenizedPrompt(p, self._encode(f"prompt {i}" if many else "prompt", p, True))
            if isinstance(p, str)
            else TokenizedPrompt(None, self._check_ids(f"prompt {i}" if many else "prompt", p))
            for i, p in enumerate(prompts)
        ]

    def _check_ids(self, name: str, token_ids: list) -> list[int]:
        try:
            return check_token_ids(token_ids, self.vocab_size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        add_special_tokens: bool,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> TokenizedPrompt:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(variables or {}),
            )
        except TemplateError as e:
            raise ValueError(f"messages: the chat template failed: {e}") from None
        self.check_length("messages", text)
        return TokenizedPrompt(text, self._encode("messages", text, add_special_tokens))

    def _encode(self, name: str, text: str, add_special_tokens: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" decodes to a lone surrogate
            raise ValueError(
                f"{name}: character {e.start} ({text[e.start]!r}) is half of a UTF-16 "
                f"surrogate pair, not text; send the whole pair or the character itself"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (as vLLM echoes a token prompt)."""
        return self.tokenizer.decode(token_ids)

    # -- vLLM's /tokenize and /detokenize ---------------------------------------------------

    async def tokenize(self, body: dict) -> dict:
        """{"prompt": str} or {"messages": [...]} -> vLLM's TokenizeResponse: count,
        max_model_len, tokens and (return_token_strs) the tokens' strings."""
        add_special_tokens = body.get("add_special_tokens", "messages" not in body)
        check_bool("add_special_tokens", add_special_tokens)
        return_token_strs = check_bool("return_token_strs", body.get("return_token_strs") or False)
        if "messages" in body:
            prompt = await self.chat_prompt(body, add_special_tokens=add_special_tokens)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise TypeError(f"prompt must be a string, got {type(text).__name__}")
            self.check_length("prompt", text)
            ids = await self.front.offload(self._encode, "prompt", text, add_special_tokens)
            prompt = TokenizedPrompt(text, ids)
        strs = None
        if return_token_strs:
            strs = await self.front.offload(self.tokenizer.convert_ids_to_tokens, prompt.token_ids)
        return {
            "count": len(prompt.token_ids),
            "max_model_len": self.max_model_len,
            "tokens": prompt.token_ids,
            "token_strs": strs,
        }

    async def detokenize(self, body: dict) -> dict:
        """{"tokens": [ids]} -> vLLM's DetokenizeResponse, {"prompt": text}."""
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise TypeError(f"tokens must be a list of token ids, got {type(tokens).__name__}")
        return {"prompt": await self.front.offload(self._detokenize, tokens)}

    def _detokenize(self, tokens: list) -> str:
        return self.decode(self._check_ids("tokens", tokens) if tokens else [])
