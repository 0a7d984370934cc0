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
    client.completions.create(model="runs/tiny", prompt="The", max_tokens=20, temperature=0)

Endpoints: ``POST /v1/completions`` (``stream=true`` for server-sent events), ``GET /v1/models``, ``GET /health``.
There is no chat endpoint: the models trained here are base language models, without a chat template.
``temperature=0`` decodes greedily, as ``model.generate(do_sample=False)``; a request field the server does not
implement (``stop``, ``n``, ``logprobs``, ...) is refused with a 422 naming it rather than ignored. Every error is
OpenAI's JSON error body.

Requests generate one at a time (one model on one device, whose ``generate()`` keeps per-call state) and wait
in a bounded queue: past ``--max-queue`` waiting requests the server answers 503 with ``Retry-After``, as a
production server sheds load it cannot take, rather than letting waits grow without bound. Each request is bounded
too: ``max_tokens`` by ``--max-tokens`` and the prompt by ``--max-prompt-tokens`` (a 400 names the limit). A
generation stops at its next token when its client goes away (streaming or not) and when the server is stopped
(Ctrl-C), so no request holds the model for a client that no longer listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    set_seed,
)

from hf_resolvent.remote_code import unsafe_pickle_problem

DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_QUEUE = 16
# Files one of which a folder needs for AutoTokenizer to find its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

try:
    import uvicorn
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from openai.types import Completion, CompletionChoice, CompletionUsage, Model
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _missing:  # the server's packages are an optional extra; main() says which install brings them
    _MISSING = _missing
else:
    _MISSING = None

    class CompletionRequest(BaseModel):
        """The fields of OpenAI's ``/v1/completions`` request that this server implements (any other is refused)."""

        model_config = ConfigDict(extra="forbid")

        model: str
        prompt: str
        max_tokens: int = Field(16, ge=1)  # OpenAI's default
        temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
        stream: bool = False
        seed: int | None = None
        user: str | None = None  # an end-user tag for the caller's logs: accepted and not used


class _Cancelled(StoppingCriteria):
    """Ends a generation at its next token once its request is cancelled or the server stops."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        stop = any(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class ServedModel:
    """One model and its tokenizer, generating for one request at a time, the others waiting in a bounded queue."""

    def __init__(self, model, tokenizer, name: str, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens, self.max_prompt_tokens, self.max_queue = max_tokens, max_prompt_tokens, max_queue
        # generate() keeps per-call state in the model's modules (the cache, the kernels' scratch): one call at a time
        self._lock = threading.Lock()
        self._admitted = threading.BoundedSemaphore(max_queue + 1)  # the one generating and those waiting
        self.stopping = threading.Event()  # the server is shutting down: every generation ends at its next token
        # No token covers more characters than its vocabulary entry has (one per byte for byte-level BPE): a prompt
        # longer than this many characters per allowed token is over the limit before it is tokenized.
        self._chars_per_token = max(map(len, tokenizer.get_vocab()), default=1)

    def inputs(self, request: CompletionRequest) -> dict:
        """The prompt's tokens on the model's device; a request naming another model, or with a prompt that is
        empty, not Unicode text or over the limits, is a 4xx."""
        if request.model != self.name:
            raise HTTPException(404, f"model {request.model!r} is not served here; this server serves {self.name!r}")
        if request.max_tokens > self.max_tokens:
            raise HTTPException(400, f"max_tokens is {request.max_tokens}, over this server's limit of "
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

    def admit(self) -> None:
        """A place in the queue for one request (released by :meth:`release`), or a 503 when the queue is full."""
        if not self._admitted.acquire(blocking=False):
            raise HTTPException(503, f"the server is busy: {self.max_queue} requests are already waiting "
                                     f"(--max-queue); retry shortly", headers={"Retry-After": "1"})

    def release(self) -> None:
        self._admitted.release()

    def generate(self, inputs: dict, request: CompletionRequest, cancel: threading.Event,
                 streamer=None) -> torch.Tensor:
        """The new tokens of one greedy (temperature 0) or sampled continuation, from an admitted request; ends early
        when ``cancel`` or :attr:`stopping` is set (while waiting for the model too)."""
        sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        while not self._lock.acquire(timeout=0.1):
            if cancel.is_set() or self.stopping.is_set():
                return inputs["input_ids"][0, :0]
        try:
            if request.seed is not None:
                set_seed(request.seed)
            out = self.model.generate(**inputs, max_new_tokens=request.max_tokens, pad_token_id=pad,
                                      streamer=streamer, stopping_criteria=StoppingCriteriaList(
                                          [_Cancelled(cancel, self.stopping)]),
                                      **(sampling if request.temperature > 0 else {"do_sample": False}))
        finally:
            self._lock.release()
        return out[0, inputs["input_ids"].shape[1]:]

    def completion(self, request: CompletionRequest, cancel: threading.Event) -> dict:
        """The completion of an admitted request (released here)."""
        try:
            inputs = self.inputs(request)
            new = self.generate(inputs, request, cancel)
        except ValueError as e:  # generate() refuses what the model cannot take (a prompt past a learned position table, ...)
            raise HTTPException(400, str(e)) from None
        finally:
            self.release()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        prompt_tokens, completion_tokens = inputs["input_ids"].shape[1], len(new)
        return _completion(text, _finish_reason(completion_tokens, request), self.name, CompletionUsage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens)).model_dump(exclude_none=True)

    def stream(self, request: CompletionRequest, gone):
        """Server-sent events of an admitted request (released when its generation ends): a chunk per piece of
        decoded text, a last one with the finish reason, ``[DONE]``. The generation is cancelled when ``gone()``
        (awaited while waiting for text) says the client went away, or when the events are closed."""
        try:
            inputs = self.inputs(request)  # before the response starts, so that its errors are still a status code
        except BaseException:
            self.release()
            raise
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel, result = threading.Event(), {}

        def run():
            try:
                result["new"] = self.generate(inputs, request, cancel, streamer)
            except Exception as e:  # reported to the client as an error event: the response has started
                result["error"] = e
            finally:
                self.release()
                streamer.end()  # the end mark, also where generate() stopped early or failed before its own

        # started here, not in events(): a response whose body is never read still ends its generation and frees
        # its place in the queue (bounded by max_tokens, when nothing cancels it)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()

        async def events():
            completion_id = _completion_id()
            chunks, watch = iter(streamer), _ClientWatch(gone, cancel)
            try:
                while (text := await watch.wait(asyncio.to_thread(next, chunks, None))) is not None:
                    if text:
                        yield _event(_completion(text, None, self.name, completion_id=completion_id))
                await asyncio.to_thread(worker.join)
                if "error" in result:
                    yield _event({"error": {"message": str(result["error"]), "type": type(result["error"]).__name__}})
                    return
                reason = _finish_reason(len(result["new"]), request)
                yield _event(_completion("", reason, self.name, completion_id=completion_id))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (the response task is cancelled), or all was sent
                cancel.set()

        return events()


class _ClientWatch:
    """Sets ``cancel`` once ``gone()`` says the client went away, asking at most every quarter of a second: uvicorn
    does not fail a send to a closed connection, so a response would otherwise generate for nobody until it ends."""

    def __init__(self, gone, cancel: threading.Event):
        self.gone, self.cancel, self.last = gone, cancel, 0.0

    async def check(self) -> None:
        now = time.monotonic()
        if now - self.last >= 0.25 and not self.cancel.is_set():
            self.last = now
            if await self.gone():
                self.cancel.set()

    async def wait(self, work):
        """The result of ``work``, checking on the client while it runs."""
        work = asyncio.ensure_future(work)
        while not (await asyncio.wait({work}, timeout=0.25))[0]:
            await self.check()
        await self.check()
        return await work


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


def _event(payload) -> str:
    text = payload.model_dump_json(exclude_none=True) if isinstance(payload, Completion) else json.dumps(payload)
    return f"data: {text}\n\n"


def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    # OpenAI's error body: its client shows error.message in the exception it raises (FastAPI's own "detail" it
    # would leave out)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status, headers=headers)


def _field_problem(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"][1:]) or "body"  # loc starts with "body"
    if error["type"] == "extra_forbidden":
        return f"{field}: not implemented by this server; leave it out"
    return f"{field}: {error['msg']}"


def build_app(served: ServedModel) -> FastAPI:
    """The FastAPI application answering for ``served``."""
    app = FastAPI(title="hf-resolvent completions")

    @app.exception_handler(StarletteHTTPException)  # ours and the router's (an unknown path)
    def http_error(request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    def invalid_request(request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "; ".join(_field_problem(error) for error in exc.errors()))

    @app.exception_handler(Exception)  # anything else: still OpenAI's error body, never a plain-text 500
    def internal_error(request, exc: Exception) -> JSONResponse:
        return _error(500, f"the server failed on this request: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        model = Model(id=served.name, created=0, object="model", owned_by="hf-resolvent")
        return {"object": "list", "data": [model.model_dump()]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served.admit()
        if body.stream:
            return StreamingResponse(served.stream(body, request.is_disconnected), media_type="text/event-stream")
        cancel = threading.Event()
        return await _ClientWatch(request.is_disconnected, cancel).wait(asyncio.to_thread(served.completion, body, cancel))

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_resolvent.serve", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a save_pretrained folder (the --output-dir of scripts/pretrain.py) or a Hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: MODEL as given)")
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
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


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
    return ServedModel(model.to(device).eval(), tokenizer, args.served_model_name or args.model,
                       max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, max_queue=args.max_queue)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if _MISSING is not None:
        parser.error(f"the server needs FastAPI, Uvicorn and the OpenAI types ({_MISSING}): "
                     f'pip install "hf-resolvent[serve]"')
    for name in ("max_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be 0 or more, got {args.max_queue}")
    served = load(args, parser)
    config = uvicorn.Config(build_app(served), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)
    _Server(config, served).run()
    return 0


if _MISSING is None:
    class _Server(uvicorn.Server):
        """Uvicorn's server, which on Ctrl-C (or SIGTERM) also ends the generations in flight at their next token:
        uvicorn alone waits for the responses to finish, and a generation can take minutes."""

        def __init__(self, config, served: ServedModel):
            super().__init__(config)
            self.served = served

        def handle_exit(self, sig, frame):
            self.served.stopping.set()
            super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
