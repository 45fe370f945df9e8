"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`).

Qwen3 and DeepSeek-R1 think before they answer, in a block that their chat templates and the
model write as

    <think>
    the thinking
    </think>

    the answer

With a parser (`nanovllm serve --reasoning-parser qwen3`, or `deepseek_r1`: the same tags, parsed
the same way, as in vLLM) a chat reply's thinking comes back as `reasoning_content` (DeepSeek's
name, the one most clients read) and `reasoning` (vLLM's name since 0.11), streamed or not, and
only the answer as `content`: what reads `content` (tool calls, a JSON schema's consumer) sees the
answer alone, and structured outputs constrain the answer alone (constrain()).

Where a reply starts: inside the thinking, unless the prompt closed it. Qwen3's template with
`chat_template_kwargs: {"enable_thinking": false}` ends the prompt with an empty block,
`<think>\\n\\n</think>\\n\\n`, and then the whole reply is the answer (vLLM's
prompt_is_reasoning_end).
Inside the thinking, the text before the first `</think>` is reasoning (without the `<think>`
that templates up to Qwen3-2507 leave the model to write), the rest is the answer; a reply that
stops or is cut off before `</think>` is all reasoning, its content null.

The text is split as it streams (ThinkingSplitter): a piece that could still grow into a tag
is held back, so streamed deltas add up to the whole reply's fields however the text is cut.
"""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from nanovllm.entrypoints.responses import with_choice_state
from nanovllm.sampling_params import SamplingParams

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both write <think>...</think>


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """The server's parser: its name and the id of the token that ends the thinking."""

    name: str
    end_token_id: int

    @classmethod
    def load(cls, name: str, tokenizer: PreTrainedTokenizerBase) -> "ReasoningParser":
        """The parser `name` for this tokenizer: both tags must be tokens of its own (the
        grammar of a structured output starts after the `</think>` token) and not special ones
        (skip_special_tokens would take them out of the text the parser reads)."""
        if name not in PARSERS:
            raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(PARSERS)}")
        vocab, special = tokenizer.get_vocab(), set(tokenizer.all_special_tokens)
        for tag in (START, END):
            if tag not in vocab or tag in special:
                raise ValueError(
                    f"reasoning parser {name!r} needs {tag} as a token of the tokenizer, not a "
                    f"special one (as Qwen3's and DeepSeek-R1's tokenizers have it)"
                )
        return cls(name, vocab[END])

    def for_prompt(self, prompt_text: str) -> "Reasoning":
        """A chat request's reasoning: its reply starts inside the thinking unless the prompt
        ends a thinking block (only whitespace after its `</think>`)."""
        return Reasoning(self, thinking=not prompt_text.rstrip().endswith(END))


@dataclass(frozen=True, slots=True)
class Reasoning:
    """One chat request's: whether its reply starts inside the thinking, and how its responses
    (whole or streamed) and its structured output are shaped by that."""

    parser: ReasoningParser
    thinking: bool

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The request's params with its structured output (a schema, a forced tool call)
        starting after the thinking: the grammar's matcher begins after `</think>`."""
        constraint = params.structured_outputs
        if constraint is None or not self.thinking:
            return params
        constraint = replace(constraint, reasoning_end_token_id=self.parser.end_token_id)
        return replace(params, structured_outputs=constraint)

    def splitter(self) -> "ThinkingSplitter":
        return ThinkingSplitter(self.thinking)

    def read(self, choice: Callable[..., dict]) -> Callable[..., dict]:
        """`choice` (a Delta -> a whole chat choice) with its text split: the thinking in
        reasoning_content and reasoning (null if the prompt closed it), the answer in content
        (null if the reply has none, when it started inside the thinking)."""

        def read(delta: object) -> dict:
            whole = choice(delta)
            reasoning, content = self.splitter().split(whole["message"]["content"])
            if self.thinking:
                fields = {"content": content or None, **thought(reasoning)}
            else:  # as without a parser
                fields = {"content": content, **thought(None)}
            return dict(whole, message=dict(whole["message"], **fields))

        return read

    async def stream(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """A chat stream's chunks with each choice's `content` deltas split into
        reasoning_content / reasoning and content deltas (one chunk may carry both, where the
        thinking ends inside it); a chunk left with nothing to say is dropped unless it carries
        logprobs or the end."""
        async for chunk, splitter in with_choice_state(chunks, self.splitter):
            if splitter is None:
                yield chunk
                continue
            choice = chunk["choices"][0]
            reasoning, content = splitter.feed(choice["delta"].get("content", ""))
            if choice["finish_reason"] is not None:
                rest_reasoning, rest_content = splitter.finish()
                reasoning, content = reasoning + rest_reasoning, content + rest_content
            delta = (thought(reasoning) if reasoning else {}) | (
                {"content": content} if content else {}
            )
            if delta or choice["logprobs"] or choice["finish_reason"]:
                yield dict(chunk, choices=[dict(choice, delta=delta)])


def thought(reasoning: str | None) -> dict:
    """The reasoning under both of its names."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


class ThinkingSplitter:
    """One reply's text, as it grows, into (reasoning, content) pieces. Left to right: inside
    the thinking, text is reasoning up to the first END, after which all is content; the first
    START is dropped; a tail that could still become a tag is held back until the next piece
    (or finish()) says what it is. Pieces fed one character at a time split as the whole."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.started = False  # the START tag was seen (and dropped)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        text, self.held = self.held + text, ""
        reasoning = []
        while self.thinking and text:
            piece, text = self._read(text)
            reasoning.append(piece)
        return "".join(reasoning), text

    def _read(self, text: str) -> tuple[str, str]:
        """The reasoning up to the next "<" (both tags begin with one), and the text after what
        stands there: a tag (END ends the thinking), a tag's beginning (held back), or text."""
        i = text.find("<")
        if i < 0:
            return text, ""
        before, text = text[:i], text[i:]
        if text.startswith(END):
            self.thinking = False
            return before, text[len(END) :]
        if not self.started and text.startswith(START):
            self.started = True
            return before, text[len(START) :]
        if self._could_become_a_tag(text):
            self.held = text
            return before, ""
        return before + "<", text[1:]

    def split(self, text: str) -> tuple[str, str]:
        """A whole reply's (reasoning, content)."""
        reasoning, content = self.feed(text)
        rest_reasoning, rest_content = self.finish()
        return reasoning + rest_reasoning, content + rest_content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended: text, not a tag."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)

    def _could_become_a_tag(self, text: str) -> bool:
        tags = (END,) if self.started else (END, START)
        return any(tag.startswith(text) for tag in tags)
