"""The engine behind an asyncio server. One thread owns the LLMEngine and runs its step
loop; the event loop reaches it only through a command queue (add, abort) that the
thread applies between steps, and gets back each request's new text and tokens per step.

    event loop ── add / abort ──> commands ──> loop thread: apply them, step(), detokenize
    event loop <── one batch of Deltas per step (call_soon_threadsafe) ───────┘

The engine is not thread-safe, so nothing else calls it: the tokenizer runs in the loop
thread too. Only a request's grammar (structured outputs) is compiled before it is queued, in
a thread of the event loop's executor, so the steps go on meanwhile. A consumer that stops
listening aborts its request, which frees its blocks before the next step.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.engine import EngineStats, LLMEngine, NewToken
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.outputs import CompletionOutput, Logprob
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import prepare

logger = logging.getLogger("nanovllm")


@dataclass(slots=True)
class Delta:
    """One choice's output since its previous Delta."""

    index: int  # the choice's index in the response
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # one entry per new token, if asked for
    finish_reason: str | None = None  # set on the choice's last Delta
    stop_reason: int | str | None = None


class ChoiceStream:
    """The text of one completion as it grows (loop thread only). Its last
    max(len(stop)) - 1 characters are held back while a stop string could still complete
    there (vLLM v1's stop_buffer_length), so no part of one is ever streamed: what is sent
    is always a prefix of the final text, which the finished CompletionOutput gives."""

    def __init__(self, index: int, tokenizer: PreTrainedTokenizerBase, params: SamplingParams):
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.hold = (
            0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        )
        self.num_chars = self.num_tokens = 0  # sent so far
        self.finished = False

    def next(self, token: NewToken) -> Delta:
        self.detokenizer.append([token.token_id])
        end = max(self.num_chars, len(self.detokenizer.text) - self.hold)
        text, self.num_chars = self.detokenizer.text[self.num_chars : end], end
        self.num_tokens += 1
        return Delta(
            self.index, text, [token.token_id], None if token.logprobs is None else [token.logprobs]
        )

    def final(self, output: CompletionOutput) -> Delta:
        sent, self.finished = self.num_tokens, True
        return Delta(
            self.index,
            output.text[self.num_chars :],
            output.token_ids[sent:],
            None if output.logprobs is None else output.logprobs[sent:],
            output.finish_reason,
            output.stop_reason,
        )


class RequestStream:
    """One API request: its prompts (each an engine request of n choices), the queue its
    Deltas arrive on, and (loop thread) the state of each choice."""

    def __init__(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        add_special_tokens: bool,
        loop: asyncio.AbstractEventLoop,
    ):
        self.prompts, self.params, self.add_special_tokens = prompts, params, add_special_tokens
        self.num_choices = len(prompts) * params.n
        self.added = loop.create_future()  # done once the engine took (or refused) it
        self.queue: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()
        self.prompt_token_ids: list[list[int]] = []  # per prompt, as the engine got them
        self.request_ids: list[int] = []
        self.choices: list[ChoiceStream] = []  # the loop thread's
        self.num_finished = 0  # the consumer's count of choices whose last Delta came


class AsyncEngine:
    """Runs `engine` in a thread of its own; start() from the event loop that will
    consume the streams, close() to stop it and release the engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # the event loop may only render chat templates
        self.stats: EngineStats = engine.stats()  # as of the last step, for /metrics
        self.num_prompt_tokens = self.num_generation_tokens = 0  # totals, for /metrics
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[
            int, tuple[RequestStream, int]
        ] = {}  # engine id -> (stream, first choice)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Abort what is in flight, stop the thread, release the engine (and TP workers)."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join()
        self.engine.close()

    # -- the event loop's side --------------------------------------------------------

    async def add_request(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Queue the prompts (text is tokenized in the loop thread); raises the engine's
        TypeError / ValueError if one is refused, in which case none is queued."""
        if params.structured_outputs is not None:  # compiled here: the steps go on meanwhile
            await asyncio.get_running_loop().run_in_executor(None, prepare, self.engine, params)
        stream = RequestStream(prompts, params, add_special_tokens, self._loop)
        self._commands.put(lambda: self._add(stream))
        try:
            await stream.added
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    async def deltas(self, stream: RequestStream) -> AsyncIterator[list[Delta]]:
        """The stream's Deltas, a batch per step, until every choice has finished; a
        consumer that leaves early aborts the request."""
        try:
            while stream.num_finished < stream.num_choices:
                batch = await stream.queue.get()
                if isinstance(batch, BaseException):
                    raise batch
                stream.num_finished += sum(d.finish_reason is not None for d in batch)
                yield batch
        finally:
            self.abort(stream)

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's request unless it has finished (harmless to repeat)."""
        if stream.num_finished < stream.num_choices:
            self._commands.put(lambda: self._abort(stream, notify=False))

    def abort_all(self) -> None:
        """Abort every request in flight; their streams end with finish_reason "abort".
        Safe in a signal handler (it only schedules a callback on the event loop)."""
        self._loop.call_soon_threadsafe(self._commands.put, self._abort_all)

    # -- the loop thread's side -------------------------------------------------------

    def _run(self) -> None:
        while self._apply_commands(block=self.engine.is_finished()):
            if not self.engine.is_finished():
                self._step()
            self.stats = self.engine.stats()
        for stream in {stream for stream, _ in self._streams.values()}:
            self._abort(stream, notify=False)  # closing: the event loop has stopped

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (wait for one if `block`); False once close() asked."""
        try:
            command = self._commands.get(block=block)
            while command is not None:
                command()
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _add(self, stream: RequestStream) -> None:
        try:
            for prompt in stream.prompts:
                token_ids = (
                    self.tokenizer.encode(prompt, add_special_tokens=stream.add_special_tokens)
                    if isinstance(prompt, str)
                    else prompt
                )
                stream.request_ids.append(self.engine.add_request(token_ids, stream.params))
                stream.prompt_token_ids.append(token_ids)
        except Exception as e:  # e.g. a prompt too long: refuse the whole request
            for request_id in stream.request_ids:
                self.engine.abort_request(request_id)
            if len(stream.prompts) > 1 and isinstance(e, (TypeError, ValueError)):
                kind = TypeError if isinstance(e, TypeError) else ValueError
                e = kind(f"prompt {len(stream.request_ids)}: {e}")  # which prompt of the list
            self._reply(stream.added, e)
            return
        for i, request_id in enumerate(stream.request_ids):
            self._streams[request_id] = (stream, i * stream.params.n)
        stream.choices = [
            ChoiceStream(i, self.tokenizer, stream.params) for i in range(stream.num_choices)
        ]
        self.num_prompt_tokens += sum(map(len, stream.prompt_token_ids))
        self._reply(stream.added, None)

    def _abort(self, stream: RequestStream, notify: bool) -> None:
        for request_id in stream.request_ids:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
        if notify:  # the consumer is still there: end each unfinished choice
            self._post(
                {
                    stream: [
                        Delta(c.index, "", [], None, "abort")
                        for c in stream.choices
                        if not c.finished
                    ]
                }
            )

    def _abort_all(self) -> None:
        for stream in {stream for stream, _ in self._streams.values()}:
            self._abort(stream, notify=True)

    def _step(self) -> None:
        try:
            out = self.engine.step()
        except Exception as e:  # the engine dropped every request; their consumers get e
            logger.exception("engine step failed")
            self._post({stream: e for stream, _ in self._streams.values()})
            self._streams.clear()
            return
        self.num_generation_tokens += len(out.new_tokens)
        self._post(self._batches(out.new_tokens, out.finished))

    def _batches(
        self, new_tokens: list[NewToken], finished: list[CompletionOutput]
    ) -> dict[RequestStream, list[Delta]]:
        """Each stream's Deltas of one step: a token each for unfinished choices, the
        rest of the final text for finished ones."""
        batches: dict[RequestStream, list[Delta]] = {}
        ended = {(output.seq_id, output.index) for output in finished}
        for token in new_tokens:
            if (token.request_id, token.index) not in ended and token.request_id in self._streams:
                stream, first = self._streams[token.request_id]
                if token.logprobs is not None:
                    self.engine.decode_logprobs([token.logprobs])
                batches.setdefault(stream, []).append(
                    stream.choices[first + token.index].next(token)
                )
        for output in finished:
            stream, first = self._streams[output.seq_id]
            batches.setdefault(stream, []).append(
                stream.choices[first + output.index].final(output)
            )
            if all(choice.finished for choice in stream.choices):
                for request_id in stream.request_ids:
                    del self._streams[request_id]
        return batches

    def _post(self, batches: dict[RequestStream, list[Delta] | BaseException]) -> None:
        if batches:
            self._loop.call_soon_threadsafe(_deliver, batches)

    def _reply(self, future: asyncio.Future, error: BaseException | None) -> None:
        def reply() -> None:
            if not future.done():  # not cancelled meanwhile
                future.set_result(None) if error is None else future.set_exception(error)

        self._loop.call_soon_threadsafe(reply)


def _deliver(batches: dict[RequestStream, list[Delta] | BaseException]) -> None:
    for stream, batch in batches.items():
        stream.queue.put_nowait(batch)
