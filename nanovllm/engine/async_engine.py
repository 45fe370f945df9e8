"""The engine behind an asyncio server. One thread owns the LLMEngine and runs its step
loop; the event loop reaches it only through a command queue (add, abort) that the
thread applies between steps, and gets back each request's new text and tokens per step.

    event loop ── offload ──> tokenizer thread: templates, tokenize, make_request (checks)
    event loop ── add / abort / call ──> commands ──> loop thread: apply them, step(), detokenize
    event loop <── one batch of Deltas per step (call_soon_threadsafe) ───────┘

The engine is not thread-safe, so the loop thread alone steps it; what costs time in
proportion to a request's size (a chat template, tokenizing, checking token ids, compiling a
structured output's grammar: the engine's make_request) runs in the tokenizer thread, so a huge
prompt delays neither the steps nor the event loop (a grammar is compiled beforehand in a
thread of its own: add_request). One tokenizer thread, as vLLM's: a fast
tokenizer's settings are not safe to share between threads. A consumer that stops listening
aborts its request, which frees its blocks before the next step.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from nanovllm.engine import EngineStats, LLMEngine, NewToken
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.llm_engine import EngineRequest
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")
T = TypeVar("T")


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
        self, requests: list[EngineRequest], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ):
        self.requests, self.params = requests, params
        self.num_choices = len(requests) * params.n
        self.added = loop.create_future()  # done once the engine took (or refused) it
        self.queue: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()
        self.prompt_token_ids = [r.prompt_token_ids for r in requests]  # per prompt
        # Per prompt, if params.prompt_logprobs: set (loop thread) before its last Delta is sent.
        self.prompt_logprobs: list[list[dict[int, Logprob] | None] | None] = [None] * len(requests)
        self.request_ids: list[int] = []
        self.choices: list[ChoiceStream] = []  # the loop thread's
        self.num_finished = 0  # the consumer's count of choices whose last Delta came


class AsyncEngine:
    """Runs `engine` in a thread of its own; start() from the event loop that will
    consume the streams, close() to stop it and release the engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # for offload()ed work only
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-tokenizer")
        self.stats: EngineStats = engine.stats()  # as of the last step, for /metrics
        self.num_prompt_tokens = self.num_generation_tokens = 0  # totals, for /metrics
        # The prefix cache, as requests finish (vLLM's prefix_cache_queries and _hits): their
        # prompt tokens, and those of them found in the cache when they were first scheduled.
        self.num_prefix_cache_queries = self.num_prefix_cache_hits = 0
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[
            int, tuple[RequestStream, int]
        ] = {}  # engine id -> (stream, first choice)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # abort_all() came: what is added now is aborted
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
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # -- the event loop's side --------------------------------------------------------

    async def offload(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in the tokenizer thread: work on a request's text or tokens, whose time
        grows with its size."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in the loop thread, between two steps (what changes the engine's state
        outside a request: adding or removing a LoRA adapter); raises what fn raises."""
        done = self._loop.create_future()

        def command() -> None:
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            self._reply(done, error, result)

        self._commands.put(command)
        return await done

    async def add_request(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        lora_int_id: int = 0,
    ) -> RequestStream:
        """Check the prompts (in the tokenizer thread: the engine's make_request) and queue
        them; raises the engine's TypeError / ValueError if one is refused, in which case none
        is queued. A structured output's grammar is compiled first in a thread of its own (its
        cache then answers make_request), so a slow one holds up no other request.
        `lora_int_id`: the LoRA adapter the prompts run under, one the engine has (added with
        call(engine.add_lora, ...)), checked again as they are queued."""
        if params.structured_outputs is not None:
            prepare = self.engine.prepare_structured_outputs
            await asyncio.get_running_loop().run_in_executor(None, prepare, params)
        requests = await self.offload(self._make_requests, prompts, params, lora_int_id)
        stream = RequestStream(requests, params, self._loop)
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
        """Abort every request in flight, and those added from now on (the server is
        stopping); their streams end with finish_reason "abort". Safe in a signal handler
        (it only schedules a callback on the event loop)."""
        self._loop.call_soon_threadsafe(self._commands.put, self._abort_all)

    def _make_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        lora_int_id: int,
    ) -> list[EngineRequest]:
        """The engine's checks of each prompt (make_request reads only what never changes);
        an error names the prompt, if there are several."""
        requests = [
            self.engine.make_request(prompt, params, i if len(prompts) > 1 else None)
            for i, prompt in enumerate(prompts)
        ]
        return [replace(request, lora_int_id=lora_int_id) for request in requests]

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
            for request in stream.requests:
                stream.request_ids.append(self.engine.add_request(request))
        except Exception as e:  # checked already: e.g. the engine was closed meanwhile
            for request_id in stream.request_ids:
                self.engine.abort_request(request_id)
            self._reply(stream.added, e)
            return
        for i, request_id in enumerate(stream.request_ids):
            self._streams[request_id] = (stream, i * stream.params.n)
        stream.choices = [
            ChoiceStream(i, self.tokenizer, stream.params) for i in range(stream.num_choices)
        ]
        self.num_prompt_tokens += sum(map(len, stream.prompt_token_ids))
        self._reply(stream.added, None)
        if self._stopping:  # it was being checked when abort_all() came
            self._abort(stream, notify=True)

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
        self._stopping = True
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
        for output in out.finished_requests:
            self.num_prefix_cache_queries += len(output.prompt_token_ids)
            self.num_prefix_cache_hits += output.num_cached_tokens or 0
        self._keep_prompt_logprobs(out.finished_requests)
        self._post(self._batches(out.new_tokens, out.finished))

    def _keep_prompt_logprobs(self, finished: list[RequestOutput]) -> None:
        """Hand each finished request's prompt logprobs (if asked) to its stream."""
        for output in finished:
            if output.prompt_logprobs is not None and int(output.request_id) in self._streams:
                stream, first = self._streams[int(output.request_id)]
                stream.prompt_logprobs[first // stream.params.n] = output.prompt_logprobs

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

    def _reply(
        self, future: asyncio.Future, error: BaseException | None, result: object = None
    ) -> None:
        def reply() -> None:
            if not future.done():  # not cancelled meanwhile
                future.set_result(result) if error is None else future.set_exception(error)

        self._loop.call_soon_threadsafe(reply)


def _deliver(batches: dict[RequestStream, list[Delta] | BaseException]) -> None:
    for stream, batch in batches.items():
        stream.queue.put_nowait(batch)
