"""An OpenAI-compatible completions server for a saved model: ``python -m hf_resolvent.serve MODEL``.

``transformers serve`` cannot load a resolvent model: it finds the model class by looking the config's
``architectures[0]`` up in the ``transformers`` namespace, which holds only the library's own models, with or without
``--trust-remote-code``, and it offers no way to register another class. This server loads the folder with
``AutoModelForCausalLM`` instead (in this process the package has registered the resolvent classes, so the installed
model code is used) and answers OpenAI's text-completion API, so any OpenAI client works with it:

    pip install "hf-resolvent[serve]"
    python -m hf_resolvent.serve runs/tiny --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="tiny", prompt="The", max_tokens=20, temperature=0)

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream=true`` for server-sent events),
``GET /v1/models``, ``GET /health``. A chat's messages become the prompt through the tokenizer's chat template; the
base models trained here have none, and their chats read as one ``Role: text`` line per message, then
``Assistant:``. A local folder is served under its own name (``tiny`` for ``runs/tiny``), or
``--served-model-name``.

Decoding: ``temperature`` 0, or below 1e-5, decodes greedily, as ``model.generate(do_sample=False)``; above it, tokens
are drawn from the request's own random generator: seeded by ``seed`` (any integer from -2**63 to 2**64 - 1, what
torch's generators take), the same request gives the same text; without one, from fresh entropy. One request's seed
never sets another's sampling. A request field the server does not implement (``stop``, ``n``, ``logprobs``, ...) is
refused with a 422 naming it rather than ignored. Every error is OpenAI's JSON error body, and a value it echoes is
cut to a few dozen characters.

Requests generate one at a time (one model on one device, whose ``generate()`` keeps per-call state) and wait in a
bounded queue, holding no thread while they wait: past ``--max-queue`` waiting requests the server answers 503 with
``Retry-After``. Each request is bounded: ``max_tokens`` by ``--max-tokens``, the prompt by ``--max-prompt-tokens``
(a 400 names the limit), the body by ``--max-body-bytes`` (413, before it is read whole), ``model`` and ``user`` by
256 characters. A request is checked before its response starts, and a stream starts with its first token, so a
refused or failed request is a status code, streaming or not. A generation stops at its next token when its client
goes away, waiting or generating, streaming or not.

Connections: a client has ``--request-timeout`` seconds to send a request's headers and as long again for its body
(else 408 and the connection is closed); an idle connection is closed after ``--timeout-keep-alive`` seconds; at most
``--max-connections`` are held (by default well below the process's file-descriptor limit), the oldest idle one
closed to make room for a new one. Such events are logged once, then counted.

Access: ``--api-key`` (or the environment variable ``HF_RESOLVENT_API_KEY``) makes every endpoint but ``/health``
require ``Authorization: Bearer KEY``; bound to an address other than loopback without a key, the server warns that
anyone who can reach it may use it. Bound to loopback, it answers only requests whose ``Host`` is ``localhost``,
``127.0.0.1`` or ``[::1]`` (a web page that rebinds its own name to 127.0.0.1 gets a 421). There are no ``/docs``.

Stopping: Ctrl-C (or SIGTERM) ends every generation at its next token: a cut stream ends with an error event saying
the server is shutting down (and no ``[DONE]``), a cut or waiting request gets a 503, and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextStreamer,
)

from hf_resolvent.remote_code import unsafe_pickle_problem

try:
    import resource
except ImportError:  # Windows: no descriptor limit to read; --max-connections keeps its fixed default
    resource = None

DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_QUEUE = 16
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds to send a request's headers, and as long again for its body
DEFAULT_KEEP_ALIVE = 5  # seconds an idle connection is kept between requests (uvicorn's own default)
DEFAULT_MAX_CONNECTIONS = 4096  # at most, where the descriptor limit allows more
# The default body limit: a prompt of --max-prompt-tokens tokens at 64 bytes of JSON each (a token of text is a few
# bytes; escapes such as \n or \u00e9 take 2 to 6 bytes a character), and 64 KiB for the other fields.
BODY_BYTES_PER_PROMPT_TOKEN = 64
BODY_BYTES_BESIDE_PROMPT = 64 * 1024
# A temperature below this decodes greedily: sampling at it all but always picks the greedy token, and dividing the
# logits by a tiny one overflows to inf and nan.
GREEDY_BELOW = 1e-5
MAX_NAME_CHARS = 256  # `model` and `user`
ECHO_CHARS = 40  # of a client's value quoted back in an error message
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
API_KEY_ENV = "HF_RESOLVENT_API_KEY"
# The chat template of a tokenizer without one (base models): "System: ...\nUser: ...\nAssistant:". The vLLM plugin
# registers the same file as vLLM's fallback for the model type.
PLAIN_CHAT_TEMPLATE = Path(__file__).with_name("plain_chat_template.jinja")
SHUTTING_DOWN = "the server is shutting down, and this request was cut short: retry it once the server is back"
# Files one of which a folder needs for AutoTokenizer to find its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

logger = logging.getLogger("uvicorn.error")  # uvicorn's configured logger: --log-level governs it

try:
    import uvicorn
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from openai.types import Completion, CompletionChoice, CompletionUsage, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _missing:  # the server's packages are an optional extra; main() says which install brings them
    _MISSING = _missing
else:
    _MISSING = None

    class CompletionRequest(BaseModel):
        """The fields of OpenAI's ``/v1/completions`` request that this server implements (any other is refused)."""

        model_config = ConfigDict(extra="forbid")

        model: str = Field(max_length=MAX_NAME_CHARS)
        prompt: str
        max_tokens: int = Field(16, ge=1)  # OpenAI's default
        temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
        stream: bool = False
        seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
        user: str | None = Field(None, max_length=MAX_NAME_CHARS)  # an end-user tag for the caller's logs: not used

    class ChatMessage(BaseModel):
        """One message of a chat: its role and its text (a string, or OpenAI's list of text parts)."""

        model_config = ConfigDict(extra="forbid")

        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[TextPart]
        name: str | None = Field(None, max_length=MAX_NAME_CHARS)

        def text(self) -> str:
            return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="forbid")

        type: Literal["text"]
        text: str

    ChatMessage.model_rebuild()

    class ChatRequest(BaseModel):
        """The fields of OpenAI's ``/v1/chat/completions`` request that this server implements (any other is
        refused): the completion request's, with ``messages`` for ``prompt``."""

        model_config = ConfigDict(extra="forbid")

        model: str = Field(max_length=MAX_NAME_CHARS)
        messages: list[ChatMessage] = Field(min_length=1)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
        temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
        stream: bool = False
        seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
        user: str | None = Field(None, max_length=MAX_NAME_CHARS)


def _clip(value, limit: int = ECHO_CHARS) -> str:
    """``str(value)``, cut to ``limit`` characters: what a client sent is quoted back, never whole."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


class _Cancelled(StoppingCriteria):
    """Ends a generation at its next token once its client went away or the server stops; says which in ``fired``."""

    def __init__(self, cancel: threading.Event, stopping: threading.Event):
        self.cancel, self.stopping, self.fired = cancel, stopping, None

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        if self.fired is None:
            self.fired = "gone" if self.cancel.is_set() else "stopping" if self.stopping.is_set() else None
        return torch.full((input_ids.shape[0],), self.fired is not None, dtype=torch.bool, device=input_ids.device)


class _Sampler(LogitsProcessor):
    """Draws the next token from the request's own generator (after temperature and top-p) and leaves only that token
    possible, so that generate()'s greedy step takes it. generate() itself samples with torch's process-wide
    generator, which one request's seed would set for every request after it, and takes no generator of its own."""

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator):
        self.temperature, self.top_p, self.generator = temperature, top_p, generator

    def __call__(self, input_ids, scores):
        logits = scores.float() / self.temperature
        if self.top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            # a token is left out once the likelier ones before it hold top_p of the probability (the first never is)
            outside = probs.cumsum(dim=-1) - probs >= self.top_p
            logits = logits.scatter(-1, order, ordered.masked_fill(outside, -math.inf))
        token = torch.multinomial(logits.softmax(dim=-1), 1, generator=self.generator)
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)


class _Streamer(TextStreamer):
    """Hands a generation's decoded text to the event loop as it comes (``post`` is thread-safe), after a mark when
    the first token is there: nothing waits on the other side in a thread of its own."""

    def __init__(self, tokenizer, post):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.post, self.started = post, False

    def put(self, value):
        if not self.next_tokens_are_prompt and not self.started:  # the first generated token
            self.started = True
            self.post(_STARTED)
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if text:
            self.post(text)


_STARTED, _END, _GONE = object(), object(), object()  # marks: first token, end of a job's events; a client gone


class _Job:
    """One admitted request. It waits for its turn on the event loop (holding no thread), then generates in a thread of
    its own, which hands text and its end back with ``loop.call_soon_threadsafe``. ``begun`` is done at the first
    token or at the end, ``ended`` once the model is free again; ``events`` holds pieces of text, then ``_END``."""

    def __init__(self, served: ServedModel, inputs: dict, request: CompletionRequest, stream: bool):
        self.served, self.inputs, self.request = served, inputs, request
        self.id = _completion_id()
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()  # its client went away: the generation ends at its next token
        self.events: asyncio.Queue = asyncio.Queue()
        self.begun, self.ended = self.loop.create_future(), self.loop.create_future()
        self.outcome = None  # "length", "stop" (a natural end), "gone", "stopping", "cancelled", "error"
        self.new, self.text, self.error = None, "", None
        self.generating = False
        self.streamer = _Streamer(served.tokenizer, self._post_event) if stream else None
        # a task, so that its client's leaving cancels the wait (asyncio.Lock gives the turn on to the next one then)
        self._waiting = self.loop.create_task(served._turn.acquire())
        self._waiting.add_done_callback(self._turn_taken)

    def abandon(self) -> None:
        """Its client went away: leave the queue, or end the generation at its next token."""
        self.cancel.set()
        if not self.generating:
            self._waiting.cancel()

    def _turn_taken(self, waiting: asyncio.Task) -> None:
        if waiting.cancelled():
            self._end("gone" if self.cancel.is_set() else "cancelled")
            return
        if self.cancel.is_set() or self.served.stopping.is_set():
            self.served._turn.release()
            self._end("gone" if self.cancel.is_set() else "stopping")
            return
        self.generating = True
        threading.Thread(target=self._generate, name=f"generate {self.id}", daemon=True).start()

    def _post(self, callback, *args) -> None:  # from the generation thread
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the process is exiting and nobody waits for this any more
            pass

    def _post_event(self, item) -> None:
        self._post(self._deliver, item)

    def _deliver(self, item) -> None:
        if item is _STARTED:
            if not self.begun.done():
                self.begun.set_result(True)
        else:
            self.events.put_nowait(item)

    def _generate(self) -> None:  # the generation thread
        new = text = error = stopped = None
        try:
            new, stopped = self.served.generate(self.inputs, self.request, self.cancel, self.streamer)
            if self.streamer is None:
                text = self.served.tokenizer.decode(new, skip_special_tokens=True)
        except Exception as e:  # answered to the client (a status, or an error event once a stream has started)
            error = e
        finally:
            self._post(self._generated, new, text, stopped, error)

    def _generated(self, new, text, stopped, error) -> None:  # on the loop, once generate() has returned
        self.served._turn.release()
        self.new, self.text, self.error = new, text or "", error
        if error is not None:
            self._end("error")
        else:
            self._end(stopped or _finish_reason(len(new), self.request))

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self.served._release()
        tokens = 0 if self.new is None else len(self.new)
        if outcome == "error":
            # the first failure of a kind with its traceback (a fault to look into), the others a line each
            first = type(self.error) not in self.served.failures_logged and not isinstance(self.error, ValueError)
            self.served.failures_logged.add(type(self.error))
            logger.warning("%s failed: %s: %s", self.id, type(self.error).__name__, _clip(self.error, 300),
                           exc_info=self.error if first else None)
        elif outcome in ("length", "stop"):
            logger.info("%s finished (%s): %d new tokens", self.id, outcome, tokens)
        else:
            why = {"gone": "the client went away", "stopping": "the server is shutting down",
                   "cancelled": "the request was cancelled"}[outcome]
            logger.info("%s: %s %s", self.id, why, f"after {tokens} new tokens" if self.generating else
                        "while it waited; nothing generated")
        self.events.put_nowait(_END)
        for future in (self.begun, self.ended):
            if not future.done():
                future.set_result(outcome)

    def failure(self) -> HTTPException | None:
        """What a request whose job ended before its first token (or without a completion) is answered."""
        if self.outcome == "error":
            if isinstance(self.error, ValueError):  # generate() refuses what the model cannot take
                return HTTPException(400, _clip(self.error, 1000))
            return HTTPException(500, f"the server failed on this request: {type(self.error).__name__}: "
                                      f"{_clip(self.error, 1000)}")
        if self.outcome == "stopping":
            return HTTPException(503, SHUTTING_DOWN)
        if self.outcome == "cancelled":
            return HTTPException(503, "the request was cancelled before it finished: retry it")
        return None


class ServedModel:
    """One model and its tokenizer, generating for one request at a time, the others waiting in a bounded queue."""

    def __init__(self, model, tokenizer, name: str, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens, self.max_prompt_tokens, self.max_queue = max_tokens, max_prompt_tokens, max_queue
        # generate() keeps per-call state in the model's modules (the cache, the kernels' scratch): one call at a time.
        # Requests wait for their turn on the event loop (FIFO, cancellable), not in threads.
        self._turn = asyncio.Lock()
        self._admitted = 0  # the one generating and those waiting (counted on the event loop)
        self.stopping = threading.Event()  # the server is shutting down: every generation ends at its next token
        self.failures_logged: set[type] = set()
        # No token covers more characters than its vocabulary entry has (one per byte for byte-level BPE): a prompt
        # longer than this many characters per allowed token is over the limit before it is tokenized.
        self._chars_per_token = max(map(len, tokenizer.get_vocab()), default=1)

    def inputs(self, request: CompletionRequest) -> dict:
        """The prompt's tokens on the model's device; a request naming another model, or with a prompt that is
        empty, not Unicode text or over the limits, is a 4xx."""
        if request.model != self.name:
            raise HTTPException(404, f"model {_clip(request.model)!r} is not served here; this server serves "
                                     f"{self.name!r}")
        if request.max_tokens > self.max_tokens:
            raise HTTPException(400, f"max_tokens is {_clip(request.max_tokens)}, over this server's limit of "
                                     f"{self.max_tokens} (--max-tokens): ask for fewer, or restart the server with a "
                                     f"higher --max-tokens")
        try:
            request.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HTTPException(400, f"prompt is not Unicode text: {e.object[e.start:e.end]!r} at character {e.start} "
                                     f"is a lone surrogate (an unpaired \\ud800-\\udfff escape); send text that "
                                     f"UTF-8 can encode") from None
        over = (f"over this server's limit of {self.max_prompt_tokens} tokens (--max-prompt-tokens): shorten it, or "
                f"restart the server with a higher --max-prompt-tokens")
        if len(request.prompt) > self._chars_per_token * self.max_prompt_tokens:
            raise HTTPException(400, f"prompt has {len(request.prompt):,} characters, {over}")
        inputs = self.tokenizer(request.prompt, return_tensors="pt")
        n = inputs["input_ids"].shape[1]
        if n == 0:
            raise HTTPException(400, "prompt is empty: give at least one token of text to continue")
        if n > self.max_prompt_tokens:
            raise HTTPException(400, f"prompt is {n:,} tokens, {over}")
        return inputs.to(self.model.device)

    def chat_prompt(self, messages: list) -> str:
        """The text a chat's ``messages`` make for the model: the tokenizer's chat template with the assistant's turn
        opened; for a tokenizer without one (the base models trained here), the plain default of
        :data:`PLAIN_CHAT_TEMPLATE`: one ``Role: text`` line per message, then ``Assistant:``."""
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        own = getattr(self.tokenizer, "chat_template", None)
        template = None if own else PLAIN_CHAT_TEMPLATE.read_text(encoding="utf-8")
        try:
            return self.tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # a template that refuses these messages (roles out of order, ...) says why
            raise HTTPException(400, f"the model's chat template refused the messages: {_clip(e, 300)}") from None

    def admit(self) -> None:
        """A place in the queue for one request (given back when its job ends), or a 503 when the queue is full or
        the server is shutting down."""
        if self.stopping.is_set():
            raise HTTPException(503, SHUTTING_DOWN)
        if self._admitted > self.max_queue:
            raise HTTPException(503, f"the server is busy: {self.max_queue} requests are already waiting "
                                     f"(--max-queue); retry shortly", headers={"Retry-After": "1"})
        self._admitted += 1

    def _release(self) -> None:
        self._admitted -= 1

    def start(self, inputs: dict, request: CompletionRequest, stream: bool) -> _Job:
        """The job of an admitted request, waiting for its turn (on the running event loop)."""
        return _Job(self, inputs, request, stream)

    def generate(self, inputs: dict, request: CompletionRequest, cancel: threading.Event,
                 streamer=None) -> tuple[torch.Tensor, str | None]:
        """The new tokens of one greedy or sampled continuation, and "gone" or "stopping" where ``cancel`` or
        :attr:`stopping` ended it early (else None). Called by one thread at a time, with the model to itself."""
        criterion = _Cancelled(cancel, self.stopping)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        sampling = {}
        if request.temperature >= GREEDY_BELOW:
            generator = torch.Generator(device=self.model.device)
            if request.seed is None:
                generator.seed()  # fresh entropy: an unseeded request is unpredictable, whatever came before it
            else:
                generator.manual_seed(request.seed)
            sampling["logits_processor"] = LogitsProcessorList([_Sampler(request.temperature, request.top_p,
                                                                         generator)])
        out = self.model.generate(**inputs, max_new_tokens=request.max_tokens, pad_token_id=pad, do_sample=False,
                                  streamer=streamer, stopping_criteria=StoppingCriteriaList([criterion]), **sampling)
        return out[0, inputs["input_ids"].shape[1]:], criterion.fired


async def _until_done_or_gone(job: _Job, work, receive):
    """The result of ``work``, or ``_GONE`` once the client went away (the job is then abandoned at once, so that a
    request that left the queue never gets the model). Once a request's body is read, its next message is the
    client's disconnect: a send to a closed connection fails nowhere, so this is where a hang-up shows."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        job.abandon()
        return _GONE
    finally:
        work.cancel()  # no-ops once done
        gone.cancel()


async def _disconnect(receive) -> None:
    """Returns when the client of a request whose body has been read disconnects."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.25)  # a server that hands out more (empty) body messages: ask again, not in a spin


if _MISSING is None:
    class _JobStream(StreamingResponse):
        """A job's server-sent events; however the response ends (its client gone, its task cancelled, even before
        it began), a job still running is abandoned, so no generation outlives the response."""

        def __init__(self, job: _Job, chunk):
            super().__init__(_events(job, chunk), media_type="text/event-stream")
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                if self.job.outcome is None:
                    self.job.abandon()


async def _events(job: _Job, chunk):
    """A chunk per piece of decoded text (``chunk(text, finish_reason, name, id)``: a completion's or a chat's), a last
    one with the finish reason and ``[DONE]``; a stream that did not end naturally (the server shutting down, a
    failure) ends with an error event instead, and no ``[DONE]``."""
    name = job.served.name
    while (item := await job.events.get()) is not _END:
        if isinstance(item, str):
            yield _event(chunk(item, None, name, job.id))
    if job.outcome in ("length", "stop"):
        yield _event(chunk("", job.outcome, name, job.id))
        yield "data: [DONE]\n\n"
        return
    failure = job.failure() or HTTPException(499, "the client went away")
    yield _event(_error_body(failure.detail, "server_error" if failure.status_code >= 500 else "invalid_request_error"))


def _completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _finish_reason(completion_tokens: int, request: CompletionRequest) -> str:
    return "length" if completion_tokens >= request.max_tokens else "stop"


def _completion(text: str, finish_reason: str | None, model: str, usage: CompletionUsage | None = None,
                completion_id: str | None = None) -> Completion:
    # model_construct: a streamed chunk before the last has no finish reason, which OpenAI's type does not allow
    # (its client reads such chunks all the same)
    choice = CompletionChoice.model_construct(text=text, index=0, logprobs=None, finish_reason=finish_reason)
    return Completion.model_construct(id=completion_id or _completion_id(), object="text_completion",
                                      created=int(time.time()), model=model, choices=[choice], usage=usage)


def _completion_chunk(text: str, finish_reason: str | None, model: str, completion_id: str) -> Completion:
    return _completion(text, finish_reason, model, completion_id=completion_id)


def _chat(text: str, finish_reason: str, model: str, usage: CompletionUsage, completion_id: str) -> ChatCompletion:
    return ChatCompletion.model_construct(
        id=completion_id.replace("cmpl-", "chatcmpl-"), object="chat.completion", created=int(time.time()),
        model=model, usage=usage, choices=[{"index": 0, "message": {"role": "assistant", "content": text},
                                            "finish_reason": finish_reason, "logprobs": None}])


def _chat_chunk(text: str, finish_reason: str | None, model: str, completion_id: str) -> ChatCompletionChunk:
    delta = {"role": "assistant", "content": text} if text or finish_reason is None else {}
    return ChatCompletionChunk.model_construct(
        id=completion_id.replace("cmpl-", "chatcmpl-"), object="chat.completion.chunk", created=int(time.time()),
        model=model, choices=[{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}])


def _event(payload) -> str:
    text = json.dumps(payload) if isinstance(payload, dict) else payload.model_dump_json(exclude_none=True)
    return f"data: {text}\n\n"


def _error_body(message: str, kind: str) -> dict:
    # OpenAI's error body: its client shows error.message in the exception it raises (FastAPI's own "detail" it
    # would leave out)
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind), status_code=status, headers=headers)


def _field_problem(error: dict) -> str:
    field = ".".join(_clip(part) for part in error["loc"][1:]) or "body"  # loc starts with "body"
    if error["type"] == "extra_forbidden":
        return f"{field}: not implemented by this server; leave it out"
    return f"{field}: {_clip(error['msg'], 200)}"


_LOOPBACK_HOST = re.compile(r"(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", re.IGNORECASE)


def _is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


class _Gate:
    """What a request passes before the application sees it: on a loopback bind, a ``Host`` naming this machine (a
    web page whose own name was rebound to 127.0.0.1 sends that name); the API key, where one is set (``/health``
    stays open); a body within ``max_body_bytes`` (refused on its Content-Length before any of it is read, or as
    soon as a chunked one grows past it), sent within ``body_timeout`` seconds. The body is read here whole, and then
    handed to the application."""

    def __init__(self, app, *, api_key: str | None, check_host: bool, max_body_bytes: int, body_timeout: float):
        self.app, self.check_host = app, check_host
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # the lifespan
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is None:
            try:
                body = await asyncio.wait_for(self._body(receive), self.body_timeout)
            except asyncio.TimeoutError:
                refusal = _error(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                      f"(--request-timeout): send it faster, or restart the server with a higher "
                                      f"--request-timeout", headers={"Connection": "close"})
            else:
                if body is _GONE:  # the client went away while sending: nobody to answer
                    return
                if body is None:
                    refusal = self._too_large()
        if refusal is not None:
            return await refusal(scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then what comes after the body: the client's disconnect

        await self.app(scope, replay, send)

    def _refusal(self, scope, headers: dict) -> JSONResponse | None:
        close = {"Connection": "close"}  # the body is not read: the connection cannot carry another request
        if self.check_host and not _LOOPBACK_HOST.fullmatch(headers.get(b"host", b"").decode("latin-1")):
            host = _clip(headers.get(b"host", b"").decode("latin-1"))
            return _error(421, f"Host {host!r} is not this server: listening on loopback, it answers Host localhost, "
                               f"127.0.0.1 or [::1] only (a web page's own name rebound to 127.0.0.1 is refused); to "
                               f"be reached under another name, listen on its address (--host) with an --api-key",
                          headers=close)
        if self.api_key is not None and scope["path"] != "/health":
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return _error(401, "missing or wrong API key: send the server's key (--api-key or "
                                   f"{API_KEY_ENV}) as Authorization: Bearer KEY, the OpenAI client's api_key",
                              headers={**close, "WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and (len(length) > 18 or int(length) > self.max_body_bytes):  # int() of 5,000 digits fails
            return self._too_large()
        return None

    def _too_large(self) -> JSONResponse:
        return _error(413, f"the request body is over this server's limit of {self.max_body_bytes:,} bytes "
                           f"(--max-body-bytes): send a shorter prompt, or restart the server with a higher "
                           f"--max-body-bytes", headers={"Connection": "close"})

    async def _body(self, receive):
        """The body, None once it is over the limit, or ``_GONE`` when the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def build_app(served: ServedModel, *, api_key: str | None = None, check_host: bool = False,
              max_body_bytes: int | None = None, body_timeout: float = DEFAULT_REQUEST_TIMEOUT):
    """The ASGI application answering for ``served``: FastAPI's routes behind :class:`_Gate`."""
    app = FastAPI(title="hf-resolvent completions", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)  # ours and the router's (an unknown path)
    def http_error(request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    def invalid_request(request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "; ".join(_field_problem(error) for error in exc.errors()[:5]))

    @app.exception_handler(Exception)  # anything else: still OpenAI's error body, never a plain-text 500
    def internal_error(request, exc: Exception) -> JSONResponse:
        return _error(500, f"the server failed on this request: {type(exc).__name__}: {_clip(exc, 1000)}",
                      "server_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        model = Model(id=served.name, created=0, object="model", owned_by="hf-resolvent")
        return {"object": "list", "data": [model.model_dump()]}

    async def answer(body: CompletionRequest, request: Request, chunk, whole):
        """A completion request's answer: its stream of ``chunk``s, or ``whole(text, finish_reason, usage, id)``."""
        # tokenizing a long prompt is work, not waiting: a pool thread for that while, off the event loop
        inputs = await asyncio.to_thread(served.inputs, body)
        served.admit()
        job = served.start(inputs, body, stream=body.stream)
        try:
            # a stream starts with its first token, so that what fails before it is still a status code
            waited = await _until_done_or_gone(job, asyncio.shield(job.begun if body.stream else job.ended),
                                               request.receive)
        except BaseException:  # this request's task was cancelled
            job.abandon()
            raise
        if waited is _GONE or job.outcome == "gone":
            return Response(status_code=499)  # nginx's "client closed request": there is nobody left to read it
        if body.stream and job.outcome in (None, "length", "stop"):
            return _JobStream(job, chunk)
        failure = job.failure()
        if failure is not None:
            raise failure
        prompt_tokens, completion_tokens = inputs["input_ids"].shape[1], len(job.new)
        usage = CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)
        return whole(job.text, job.outcome, usage, job.id).model_dump(exclude_none=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(body, request, _completion_chunk,
                            lambda text, reason, usage, cid: _completion(text, reason, served.name, usage, cid))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise HTTPException(400, "give max_tokens or max_completion_tokens (its newer name), not both")
        prompt = served.chat_prompt(body.messages)
        as_completion = CompletionRequest.model_construct(
            model=body.model, prompt=prompt, max_tokens=body.max_completion_tokens or body.max_tokens or 16,
            temperature=body.temperature, top_p=body.top_p, stream=body.stream, seed=body.seed, user=body.user)
        return await answer(as_completion, request, _chat_chunk,
                            lambda text, reason, usage, cid: _chat(text, reason, served.name, usage, cid))

    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(served.max_prompt_tokens)
    return _Gate(app, api_key=api_key, check_host=check_host, max_body_bytes=max_body_bytes,
                 body_timeout=body_timeout)


def default_max_body_bytes(max_prompt_tokens: int) -> int:
    return BODY_BYTES_PER_PROMPT_TOKEN * max_prompt_tokens + BODY_BYTES_BESIDE_PROMPT


# --------------------------------------------------------------------------------------------------
# Connections: the time to send a request, how many are held, one log line per kind of event


class _Tally:
    """Logs the first event of a kind at once, then at most a line a minute counting the others, and what is left at
    shutdown: a flood of slow or idle connections must not flood the log too."""

    def __init__(self, every: float = 60.0):
        self.every, self.kinds = every, {}  # kind -> [events since its last line, time of that line]

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        entry = self.kinds.get(kind)
        if entry is None:
            self.kinds[kind] = [0, now]
            logger.warning("%s (logged once; later ones are counted)", message)
            return
        entry[0] += 1
        if now - entry[1] >= self.every:
            self.flush(kind)

    def flush(self, *kinds: str) -> None:
        now = time.monotonic()
        for kind in kinds or list(self.kinds):
            count, since = self.kinds[kind]
            if count:
                logger.warning("%s: %d more in the last %.0f s", kind, count, now - since)
            self.kinds[kind] = [0, now]


def _raw_response(status: int, reason: str, message: str, headers: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP response, for a connection that is closed at once and carries no request the server answers."""
    body = json.dumps(_error_body(message, "server_error" if status >= 500 else "invalid_request_error")).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _ConnectionGuard:
    """The connections a server holds, oldest first, at most ``max_connections`` (below the process's descriptor
    limit: past it, accepting fails and the server answers nobody); and the time a client has to send a request's
    headers (uvicorn times out only the silence between requests, and any byte restarts that)."""

    def __init__(self, max_connections: int, request_timeout: float, tally: _Tally):
        self.max_connections, self.request_timeout, self.tally = max_connections, request_timeout, tally
        self.open: dict = {}  # protocol -> None: an ordered set

    def opened(self, conn) -> bool:
        """Admits ``conn``, closing the oldest idle connection where the limit is reached; False when none is idle
        (``conn`` is then answered 503 and closed)."""
        self.open[conn] = None
        if len(self.open) <= self.max_connections:
            return True
        victim = next((c for c in self.open if c is not conn and c._hfr_idle()), None)
        if victim is not None:
            self.tally("connections evicted", f"{self.max_connections} connections open (--max-connections): "
                                              "closed the oldest idle one to make room for a new one")
            self.open.pop(victim)
            victim.transport.close()
            return True
        self.open.pop(conn)
        self.tally("connections refused", f"{self.max_connections} connections open (--max-connections), all "
                                          "of them in requests: refused a new one with a 503")
        conn.transport.write(_raw_response(503, "Service Unavailable", f"the server holds its limit of "
                                           f"{self.max_connections} connections (--max-connections): retry shortly",
                                           ("Retry-After: 1",)))
        conn.transport.close()
        return False

    def closed(self, conn) -> None:
        self.open.pop(conn, None)


def _guarded(base: type, guard: _ConnectionGuard) -> type:
    """Uvicorn's HTTP protocol class ``base``, its connections counted by ``guard`` and given ``guard.request_timeout``
    seconds from their first byte (or from connecting) to a request's last header."""

    class Guarded(base):
        _hfr_deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if guard.opened(self):
                self._hfr_arm()

        def data_received(self, data):
            if self._hfr_deadline is None and self._hfr_idle():  # a request begins
                self._hfr_arm()
            super().data_received(data)
            if self._hfr_deadline is not None and not self._hfr_idle():  # its headers are in: the app has it
                self._hfr_deadline.cancel()
                self._hfr_deadline = None

        def connection_lost(self, exc):
            if self._hfr_deadline is not None:
                self._hfr_deadline.cancel()
                self._hfr_deadline = None
            guard.closed(self)
            super().connection_lost(exc)

        def _hfr_idle(self) -> bool:
            """No request of this connection is with the application."""
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _hfr_arm(self) -> None:
            self._hfr_deadline = self.loop.call_later(guard.request_timeout, self._hfr_expire)

        def _hfr_expire(self) -> None:
            self._hfr_deadline = None
            if self.transport.is_closing() or not self._hfr_idle():
                return
            guard.tally("slow requests", f"closed a connection that sent no complete request headers within "
                                         f"{guard.request_timeout:g} s (--request-timeout)")
            self.transport.write(_raw_response(408, "Request Timeout", f"no complete request within "
                                               f"{guard.request_timeout:g} s (--request-timeout)"))
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class _Quiet(logging.Filter):
    """Counts uvicorn's complaint about each malformed request in the tally instead of a line each."""

    NOISY = {"Invalid HTTP request received.": "invalid HTTP requests"}

    def __init__(self, tally: _Tally):
        super().__init__()
        self.tally = tally

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self.NOISY.get(record.msg) if isinstance(record.msg, str) else None
        if kind is None:
            return True
        self.tally(kind, f"a malformed HTTP request, answered 400 ({record.msg})")
        return False


def _descriptor_limit() -> int | None:
    """The process's soft limit on open files, or None where there is none to read."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _backlog(limit: int | None) -> int:
    """Connections the kernel queues, and asyncio accepts in one go (each a descriptor before the guard sees it)."""
    return 2048 if limit is None else min(2048, max(16, limit // 8))


def _descriptors_needed(max_connections: int, limit: int | None) -> int:
    return max_connections + _backlog(limit) + 64  # 64: the model's files, the log, the event loop's own


def default_max_connections(limit: int | None) -> int:
    """As many connections as the descriptor limit ``limit`` leaves room for, at most DEFAULT_MAX_CONNECTIONS."""
    if limit is None:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, limit - _descriptors_needed(0, limit)))


def _accept_failures(tally: _Tally):
    """An event-loop exception handler logging a failed accept (out of descriptors) once, then counting: asyncio logs
    a traceback for each."""

    def handle(loop, context):
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            tally("accept failures", f"could not accept a connection ({exc.strerror}): lower --max-connections, or "
                                     f"raise the process's limit on open files (ulimit -n)")
            return
        loop.default_exception_handler(context)

    return handle


def _exposure_warning(host: str, api_key: str | None) -> str | None:
    if api_key is not None or _is_loopback(host):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this machine can use the model. Set "
            f"--api-key (or {API_KEY_ENV}), or listen on 127.0.0.1 only (--host 127.0.0.1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_resolvent.serve", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a save_pretrained folder (the --output-dir of scripts/pretrain.py) or a Hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: a local folder's own name, or the Hub id)")
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every endpoint but /health (default: the "
                        f"environment variable {API_KEY_ENV}, which keeps the key out of the process list; none)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype (default: as saved)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run a model folder's own code (not needed for resolvent models: hf_resolvent is installed)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"largest max_tokens a request may ask for (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help=f"longest prompt in tokens (default {DEFAULT_MAX_PROMPT_TOKENS})")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait while one generates; more get a 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest request body; a larger one gets a 413 (default: {BODY_BYTES_PER_PROMPT_TOKEN} "
                        f"bytes per --max-prompt-tokens token and {BODY_BYTES_BESIDE_PROMPT // 1024} KiB, "
                        f"{default_max_body_bytes(DEFAULT_MAX_PROMPT_TOKENS):,} bytes at the default)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help=f"seconds a client has to send a request's headers, and as long again for its body; a slower "
                        f"one gets a 408 and is disconnected (default {DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE,
                   help=f"seconds an idle connection stays open between requests (default {DEFAULT_KEEP_ALIVE})")
    p.add_argument("--max-connections", type=int, default=None,
                   help=f"connections held at once; past it the oldest idle one is closed, or a new one refused "
                        f"(default: the limit on open files less room for the rest, at most "
                        f"{DEFAULT_MAX_CONNECTIONS}; {default_max_connections(_descriptor_limit())} here)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _served_name(model: str) -> str:
    """A local folder is served under its own name (its path says where the files are, which is no client's
    business); a Hub id as given."""
    path = Path(model)
    return (Path(os.path.abspath(path)).name or model) if path.exists() else model


def load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServedModel:
    """The model and tokenizer ``args.model`` names, or a usage error that says what is missing."""
    folder = Path(args.model)
    if folder.exists() and not (folder / "config.json").is_file():
        parser.error(f"{args.model} is not a saved model folder (no config.json): pass a save_pretrained folder, "
                     f"such as the --output-dir of a finished scripts/pretrain.py run")
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(
            folder.glob("*.tiktoken")):
        parser.error(f"{args.model} has no tokenizer (no tokenizer.json, tokenizer_config.json or vocabulary file): "
                     f"save the model's tokenizer into the folder, tokenizer.save_pretrained('{args.model}'), with "
                     f"the tokenizer the model was trained with")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     trust_remote_code=args.trust_remote_code)
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused a pickle that names code to run
        pickled = next(iter(sorted(folder.glob("*.bin"))), folder / "pytorch_model.bin")
        parser.error(unsafe_pickle_problem(pickled, e))
    except (OSError, ValueError) as e:  # transformers' own messages name the missing file or setting
        parser.error(f"cannot load {args.model}: {e}")
    return ServedModel(model.to(device).eval(), tokenizer, args.served_model_name or _served_name(args.model),
                       max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, max_queue=args.max_queue)


def _max_connections(args: argparse.Namespace, parser: argparse.ArgumentParser, limit: int | None) -> int:
    """``--max-connections``, or its default; raises the soft limit on open files where a larger one needs it."""
    if args.max_connections is None:
        return default_max_connections(limit)
    needed = _descriptors_needed(args.max_connections, limit)
    if limit is not None and needed > limit:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and needed > hard:
            parser.error(f"--max-connections {args.max_connections} needs about {needed} open files, over this "
                         f"process's limit of {hard} (ulimit -n): lower --max-connections or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return args.max_connections


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if _MISSING is not None:
        parser.error(f"the server needs FastAPI, Uvicorn and the OpenAI types ({_MISSING}): "
                     f'pip install "hf-resolvent[serve]"')
    for name in ("max_tokens", "max_prompt_tokens", "max_body_bytes", "timeout_keep_alive", "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be 0 or more, got {args.max_queue}")
    if not args.request_timeout > 0:
        parser.error(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        parser.error(f"the API key (--api-key or {API_KEY_ENV}) is empty: give a key, or leave both unset")
    limit = _descriptor_limit()
    max_connections = _max_connections(args, parser, limit)
    served = load(args, parser)
    app = build_app(served, api_key=api_key, check_host=_is_loopback(args.host),
                    max_body_bytes=args.max_body_bytes or default_max_body_bytes(args.max_prompt_tokens),
                    body_timeout=args.request_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=10,
                            backlog=_backlog(limit))
    config.load()
    tally = _Tally()
    config.http_protocol_class = _guarded(config.http_protocol_class,
                                          _ConnectionGuard(max_connections, args.request_timeout, tally))
    logger.addFilter(_Quiet(tally))
    if (warning := _exposure_warning(args.host, api_key)) is not None:
        logger.warning(warning)
    _Server(config, served, tally).run()
    return 0


if _MISSING is None:
    class _Server(uvicorn.Server):
        """Uvicorn's server, which on Ctrl-C (or SIGTERM) also ends the generations in flight at their next token
        (uvicorn alone waits for the responses to finish, and a generation can take minutes), and logs a failed
        accept once."""

        def __init__(self, config, served: ServedModel, tally: _Tally):
            super().__init__(config)
            self.served, self.tally = served, tally

        def handle_exit(self, sig, frame):
            self.served.stopping.set()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own raises the signal again once it has shut down, to end the process with it: a
            # KeyboardInterrupt traceback after Ctrl-C, death by SIGTERM. A finished graceful shutdown exits with 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = getattr(uvicorn.server, "HANDLED_SIGNALS", (signal.SIGINT, signal.SIGTERM))
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(_accept_failures(self.tally))
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets=sockets)
            self.tally.flush()


if __name__ == "__main__":
    code = main()
    # Nothing is left to save: skip the interpreter's teardown of the model's modules, which takes seconds
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
