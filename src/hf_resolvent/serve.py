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
There is no chat endpoint: the models trained here are base language models, without a chat template. Requests
are answered one at a time (one model on one device). ``temperature=0`` decodes greedily, as
``model.generate(do_sample=False)``; a request field the server does not implement (``stop``, ``n``, ``logprobs``,
...) is refused with a 422 naming it rather than ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, set_seed

try:
    import uvicorn
    from fastapi import FastAPI, HTTPException
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
        temperature: float = Field(1.0, ge=0.0, le=2.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        stream: bool = False
        seed: int | None = None
        user: str | None = None  # an end-user tag for the caller's logs: accepted and not used


class ServedModel:
    """One model and its tokenizer, generating for one request at a time."""

    def __init__(self, model, tokenizer, name: str):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        # generate() keeps per-call state in the model's modules (the cache, the kernels' scratch): one call at a time
        self._lock = threading.Lock()

    def inputs(self, request: CompletionRequest) -> dict:
        """The prompt's tokens on the model's device; a request naming another model or an empty prompt is a 4xx."""
        if request.model != self.name:
            raise HTTPException(404, f"model {request.model!r} is not served here; this server serves {self.name!r}")
        inputs = self.tokenizer(request.prompt, return_tensors="pt").to(self.model.device)
        if inputs["input_ids"].shape[1] == 0:
            raise HTTPException(400, "prompt is empty: give at least one token of text to continue")
        return inputs

    def generate(self, inputs: dict, request: CompletionRequest, streamer=None) -> torch.Tensor:
        """The new tokens of one greedy (temperature 0) or sampled continuation."""
        sampling = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with self._lock:
            if request.seed is not None:
                set_seed(request.seed)
            out = self.model.generate(**inputs, max_new_tokens=request.max_tokens, pad_token_id=pad,
                                      streamer=streamer, **(sampling if request.temperature > 0 else
                                                            {"do_sample": False}))
        return out[0, inputs["input_ids"].shape[1]:]

    def completion(self, request: CompletionRequest) -> dict:
        inputs = self.inputs(request)
        try:
            new = self.generate(inputs, request)
        except ValueError as e:  # generate() refuses what the model cannot take (a prompt past a learned position table, ...)
            raise HTTPException(400, str(e)) from None
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        prompt_tokens, completion_tokens = inputs["input_ids"].shape[1], len(new)
        return _completion(text, _finish_reason(completion_tokens, request), self.name, CompletionUsage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens)).model_dump(exclude_none=True)

    def stream(self, request: CompletionRequest):
        """Server-sent events: a chunk per piece of decoded text, a last one with the finish reason, ``[DONE]``."""
        inputs = self.inputs(request)  # before the response starts, so that its errors are still a status code
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict = {}

        def run():
            try:
                result["new"] = self.generate(inputs, request, streamer)
            except Exception as e:  # reported to the client as an error event: the response has started
                result["error"] = e
                streamer.end()  # generate() did not: without the end mark the text iterator would wait forever

        def events():
            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            completion_id = _completion_id()
            for text in streamer:
                if text:
                    yield _event(_completion(text, None, self.name, completion_id=completion_id))
            worker.join()
            if "error" in result:
                yield _event({"error": {"message": str(result["error"]), "type": type(result["error"]).__name__}})
                return
            reason = _finish_reason(len(result["new"]), request)
            yield _event(_completion("", reason, self.name, completion_id=completion_id))
            yield "data: [DONE]\n\n"

        return events()


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


def _error(status: int, message: str) -> JSONResponse:
    # OpenAI's error body: its client shows error.message in the exception it raises (FastAPI's own "detail" it
    # would leave out)
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)


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
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    def invalid_request(request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "; ".join(_field_problem(error) for error in exc.errors()))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        model = Model(id=served.name, created=0, object="model", owned_by="hf-resolvent")
        return {"object": "list", "data": [model.model_dump()]}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        if request.stream:
            return StreamingResponse(served.stream(request), media_type="text/event-stream")
        return served.completion(request)

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
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServedModel:
    """The model and tokenizer ``args.model`` names, or a usage error that says what is missing."""
    folder = Path(args.model)
    if folder.exists() and not (folder / "config.json").is_file():
        parser.error(f"{args.model} is not a saved model folder (no config.json): pass a save_pretrained folder, "
                     f"such as the --output-dir of a finished scripts/pretrain.py run")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:  # transformers' own messages name the missing file or setting
        parser.error(f"cannot load {args.model}: {e}")
    return ServedModel(model.to(device).eval(), tokenizer, args.served_model_name or args.model)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if _MISSING is not None:
        parser.error(f"the server needs FastAPI, Uvicorn and the OpenAI types ({_MISSING}): "
                     f'pip install "hf-resolvent[serve]"')
    served = load(args, parser)
    uvicorn.run(build_app(served), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
