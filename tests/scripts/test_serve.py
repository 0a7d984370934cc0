"""hf_resolvent.serve: a saved model behind an OpenAI-compatible API (``transformers serve`` cannot load it), used
with the ``openai`` client: a completion and a streamed completion give ``model.generate``'s greedy text; what the
server does not implement is refused by name; a folder that is not a model stops the command with one message.
Then what careless users and hostile clients do: load, hang-ups, slow and idle connections, oversized bodies, values
at the edges, seeds, keys and Host headers, Ctrl-C, hostile weights files and folders without a tokenizer."""

from __future__ import annotations

import copy
import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest
import torch
from servers import free_port, wait_until_ready
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_resolvent import ResolventConfig, ResolventForCausalLM, serve
from hf_resolvent.training import data as D

PROMPT = "def main(argv):\n    parser = argparse."
MAX_TOKENS = 12
READY_TIMEOUT = 60  # seconds for the server to import, load the model and listen


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tok = D.train_bpe_tokenizer([d["text"] for d in D.stdlib_corpus(max_docs=5)], vocab_size=300)
    torch.manual_seed(0)
    config = ResolventConfig.from_preset("tiny", mixer="exp2:ce", vocab_size=len(tok), n_layer=1, n_embd=32,
                                         n_head=2, n_inner=64, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id)
    ResolventForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _start(model_folder, log, *flags, preexec_fn=None):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_RESOLVENT_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hf_resolvent.serve", str(model_folder), "--host", "127.0.0.1",
                                 "--port", str(port), "--served-model-name", "tiny", "--device", "cpu",
                                 "--log-level", "warning", *flags], env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=preexec_fn)
    wait_until_ready(proc, f"http://127.0.0.1:{port}/health", log, READY_TIMEOUT)
    return proc, f"http://127.0.0.1:{port}/v1/completions"


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(model_folder, tmp_path_factory):
    """An OpenAI client of a server on a free loopback port, serving ``model_folder`` under the name "tiny"."""
    proc, url = _start(model_folder, tmp_path_factory.mktemp("serve") / "server.log")
    try:
        yield openai.OpenAI(base_url=url.removesuffix("/completions"), api_key="unused", timeout=60, max_retries=0,
                            http_client=openai.DefaultHttpxClient(trust_env=False))  # no proxy for loopback
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def greedy_text(model_folder):
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), out.shape[1] - ids.shape[1]


def test_completion_equals_greedy_generate(client, greedy_text):
    text, new_tokens = greedy_text
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    (choice,) = result.choices
    assert choice.text == text
    assert result.usage.completion_tokens == new_tokens
    assert choice.finish_reason == ("length" if new_tokens == MAX_TOKENS else "stop")
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_streamed_completion_equals_greedy_generate(client, greedy_text):
    text, new_tokens = greedy_text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == text
    assert [chunk.choices[0].finish_reason for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == ("length" if new_tokens == MAX_TOKENS else "stop")


def test_chat_completions_take_the_plain_chat_of_a_base_model(client, tiny):
    """A tokenizer without a chat template (the base models trained here): the messages as 'Role: text' lines, then
    'Assistant:', and the answer is greedy generate()'s continuation of that text, whole or streamed."""
    model, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    prompt = f"System: Be brief.\nUser: {PROMPT}\nAssistant:"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    result = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.message.content == want
    assert result.object == "chat.completion" and result.usage.prompt_tokens == ids.shape[1]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[0].object == "chat.completion.chunk"
    with pytest.raises(openai.UnprocessableEntityError, match="tools"):  # not silently ignored
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, tools=[])
    with pytest.raises(openai.UnprocessableEntityError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)


def test_chat_completions_take_the_tokenizers_chat_template(tiny):
    model, tokenizer = tiny
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    served = serve.ServedModel(model, templated, "tiny")
    from starlette.testclient import TestClient

    with TestClient(serve.build_app(served), base_url="http://127.0.0.1") as app:
        answer = app.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "def f"}]})
    assert answer.status_code == 200, answer.text
    ids = templated("<user>def f<assistant>", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert answer.json()["choices"][0]["message"]["content"] == templated.decode(out[0, ids.shape[1]:],
                                                                                 skip_special_tokens=True)


def test_what_the_server_does_not_implement_is_refused_by_name(client):
    with pytest.raises(openai.UnprocessableEntityError, match="stop"):  # not silently ignored
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stop=["\n"])
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.completions.create(model="gpt2", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        client.completions.create(model="tiny", prompt="", max_tokens=2)


def test_a_folder_without_a_model_stops_with_one_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not a saved model folder (no config.json)" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------
# Faults: a client that goes away, requests past the limits, a full queue, text that is not text, Ctrl-C


ENDLESS = 1_000_000  # tokens: minutes of generation for the tiny model, unless it is stopped
ENDLESS_PROMPT = "def f"  # the streamer sends text at word ends: this prompt's continuation has spaces early


@pytest.fixture(scope="module")
def limited(model_folder, tmp_path_factory):
    """A server allowing long generations, prompts of 64 tokens and one waiting request; its completions URL."""
    proc, url = _start(model_folder, tmp_path_factory.mktemp("limited") / "server.log", "--max-tokens", str(ENDLESS),
                       "--max-prompt-tokens", "64", "--max-queue", "1")
    try:
        yield url
    finally:
        _stop(proc)


class _Answer:
    """Status, headers and JSON body of one HTTP answer."""

    def __init__(self, response):
        self.status_code, self.headers = response.status, {k.lower(): v for k, v in response.getheaders()}
        self.text = response.read().decode()

    def json(self):
        return json.loads(self.text)


def _connect(url, timeout):
    """An HTTP connection to the server of ``url`` and the path (the standard library's client: no proxies)."""
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def _send(url, content: str, timeout=30) -> _Answer:
    connection, path = _connect(url, timeout)
    try:
        connection.request("POST", path, body=content.encode("utf-8", "surrogatepass"),
                           headers={"Content-Type": "application/json"})
        return _Answer(connection.getresponse())
    finally:
        connection.close()


def _answer(sock) -> _Answer:
    """The HTTP answer that arrives on ``sock``."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return _Answer(response)


def _post(url, timeout=30, **body) -> _Answer:
    return _send(url, json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}),
                 timeout)


def _start_endless_stream(url):
    """An endless streamed completion whose first event has arrived: the connection, to close."""
    connection, path = _connect(url, 30)
    connection.request("POST", path, body=json.dumps({"model": "tiny", "prompt": ENDLESS_PROMPT, "max_tokens": ENDLESS,
                                                      "temperature": 0, "stream": True}),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    while not response.fp.readline().startswith(b"data: "):
        pass
    return connection


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_the_model(limited, stream):
    if stream:
        _start_endless_stream(limited).close()
    else:
        with pytest.raises(TimeoutError):  # the client gives up after 2 s, mid-generation
            _post(limited, timeout=2, max_tokens=ENDLESS)
    t0 = time.monotonic()
    answer = _post(limited, timeout=30)  # waits for the model: freed at the abandoned generation's next token
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 2
    assert time.monotonic() - t0 < 20


def test_requests_past_the_limits_are_refused_by_name(limited):
    answer = _post(limited, max_tokens=ENDLESS + 1)
    assert answer.status_code == 400 and "--max-tokens" in answer.json()["error"]["message"]
    t0 = time.monotonic()
    answer = _post(limited, prompt="x" * 60_000)  # within the body limit, over the characters 64 tokens can cover
    assert answer.status_code == 400 and "--max-prompt-tokens" in answer.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    answer = _post(limited, prompt=PROMPT * 8)  # within the characters, over the 64 tokens
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and "tokens" in message and "--max-prompt-tokens" in message


def test_a_full_queue_answers_503_at_once(limited):
    import concurrent.futures

    holder = _start_endless_stream(limited)  # holds the model
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_post, limited)  # the one request the queue takes
            time.sleep(1.0)
            t0 = time.monotonic()
            refused = _post(limited)
            assert refused.status_code == 503 and time.monotonic() - t0 < 5
            assert refused.headers["retry-after"] == "1" and "--max-queue" in refused.json()["error"]["message"]
            holder.close()  # the endless stream goes away: the waiting request runs
            assert waiting.result(timeout=30).status_code == 200
    finally:
        holder.close()


def test_text_that_is_not_text_gets_openais_error_body(limited):
    answer = _send(limited, '{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 2}')  # valid JSON
    assert answer.status_code == 400, answer.text
    assert "lone surrogate" in answer.json()["error"]["message"]
    answer = _send(limited, '{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": NaN}')
    assert answer.status_code == 422 and "finite number" in answer.json()["error"]["message"]


def _read_events(stream_connection_response, timeout=30) -> list[str]:
    """The ``data:`` lines of a streamed answer, read to its end."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream_connection_response.fp.readline()
        if not line:
            return lines
        if line.startswith(b"data: "):
            lines.append(line[6:].decode().strip())
    raise AssertionError(f"the stream did not end within {timeout} s: {lines[-3:]}")


def test_ctrl_c_cuts_a_stream_with_an_error_event_and_a_waiting_request_with_503(model_folder, tmp_path):
    import concurrent.futures
    import signal

    proc, url = _start(model_folder, tmp_path / "server.log", "--max-tokens", str(ENDLESS))
    try:
        connection, path = _connect(url, 30)
        connection.request("POST", path, body=json.dumps({"model": "tiny", "prompt": ENDLESS_PROMPT, "stream": True,
                                                          "max_tokens": ENDLESS, "temperature": 0}),
                           headers={"Content-Type": "application/json"})
        stream = connection.getresponse()
        assert stream.status == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_post, url, 60, max_tokens=ENDLESS)  # waits for the model, which the stream holds
            time.sleep(1.0)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            events = _read_events(stream)
            # cut by the shutdown, not finished: an error event saying so, and no [DONE]
            assert "[DONE]" not in events, events[-3:]
            last = json.loads(events[-1])
            assert "shutting down" in last["error"]["message"], events[-3:]
            answer = waiting.result(timeout=30)
            assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"], answer.text
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        log = (tmp_path / "server.log").read_text()
        assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
        connection.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_an_idle_server_exits_at_once_on_ctrl_c(model_folder, tmp_path):
    import signal

    proc, _ = _start(model_folder, tmp_path / "server.log")
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        waited = time.monotonic() - t0
        log = (tmp_path / "server.log").read_text()
        # a clean exit (no KeyboardInterrupt traceback, status 0), without seconds of interpreter teardown
        assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
        assert waited < 10, waited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# --------------------------------------------------------------------------------------------------
# Load, hang-ups, slow and idle connections, oversized bodies: a server whose process may open 256 files


OPEN_FILES = 256
REQUEST_TIMEOUT = 2  # seconds (--request-timeout)


class _Server:
    def __init__(self, proc, url, log):
        self.proc, self.url, self.log = proc, url, log
        self.port = urllib.parse.urlsplit(url).port

    def socket(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def hardened(model_folder, tmp_path_factory):
    """A server allowing long generations, prompts of 64 tokens, 12 waiting requests and 2 s to send a request, in a
    process limited to 256 open files, logging each request's end."""
    resource = pytest.importorskip("resource")

    def limit_open_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))

    log = tmp_path_factory.mktemp("hardened") / "server.log"
    proc, url = _start(model_folder, log, "--max-tokens", str(ENDLESS), "--max-prompt-tokens", "64",
                       "--max-queue", "12", "--request-timeout", str(REQUEST_TIMEOUT), "--log-level", "info",
                       preexec_fn=limit_open_files)
    try:
        yield _Server(proc, url, log)
    finally:
        _stop(proc)


def _request_bytes(body: dict) -> bytes:
    content = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\n\r\n").encode() + content


def _went_away(log: str) -> list[str]:
    return [line for line in log.splitlines() if "the client went away" in line]


def _log_lines(server: _Server, after: int, count: int, timeout: float = 30) -> list[str]:
    """The server's lines of clients gone away after the first ``after``, once there are ``count`` (or after
    ``timeout`` seconds, however many there are)."""
    deadline = time.monotonic() + timeout
    while len(gone := _went_away(server.log_text())[after:]) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return gone


def test_waiting_requests_hold_no_thread_and_hang_ups_stop_their_generation(hardened):
    holder, path = _connect(hardened.url, 30)  # an endless stream, generating
    holder.request("POST", path, body=json.dumps({"model": "tiny", "prompt": ENDLESS_PROMPT, "max_tokens": ENDLESS,
                                                  "temperature": 0, "stream": True}),
                   headers={"Content-Type": "application/json"})
    response = holder.getresponse()
    assert response.status == 200
    before = len(_went_away(hardened.log_text()))
    waiting = []
    try:
        for i in range(10):  # more than asyncio's default thread pool has threads (6 on 2 cores)
            sock = hardened.socket()
            sock.sendall(_request_bytes({"model": "tiny", "prompt": ENDLESS_PROMPT, "max_tokens": ENDLESS,
                                         "temperature": 0, "stream": i % 2 == 0}))
            waiting.append(sock)
        time.sleep(1.0)  # they reach the queue
        # the generating stream still delivers its text while ten requests wait for the model
        received = 0
        while received < 20:
            if response.fp.readline().startswith(b"data: "):
                received += 1
        for sock in waiting:  # they hang up while waiting: they leave the queue and generate nothing
            sock.close()
        gone = _log_lines(hardened, before, 10)
        assert len(gone) == 10 and all("while it waited; nothing generated" in line for line in gone), gone
        assert response.fp.readline()  # the stream goes on
    finally:
        for sock in waiting:
            sock.close()
        holder.close()  # it hangs up while generating: its generation ends at its next token
    (stopped,) = _log_lines(hardened, before + 10, 1)
    assert int(re.search(r"after (\d+) new tokens", stopped).group(1)) < ENDLESS
    answer = _post(hardened.url, timeout=30)  # the model is free, the queue empty
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 2


def _closed_within(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends before it closes ``sock`` (within ``timeout`` seconds, else socket.timeout)."""
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_slow_and_idle_connections_are_closed_and_their_number_bounded(hardened):
    silent = hardened.socket()  # connects and says nothing
    half = hardened.socket()  # headers never finished
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    trickle = hardened.socket()  # a body sent a byte at a time
    request = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 2}
    body = json.dumps(request).encode()
    trickle.sendall(_request_bytes(request)[:-len(body)])
    try:
        deadline = time.monotonic() + 20
        for byte in body:
            assert time.monotonic() < deadline, "the server still reads a body trickled for 20 s"
            if select.select([trickle], [], [], 0.3)[0]:
                break
            trickle.sendall(bytes([byte]))
        answer = _answer(trickle)
        assert answer.status_code == 408 and "--request-timeout" in answer.json()["error"]["message"]
        for sock in (silent, half):
            received = _closed_within(sock, 20)
            assert received == b"" or received.startswith(b"HTTP/1.1 408 "), received
    finally:
        for sock in (silent, half, trickle):
            sock.close()
    # more idle connections than the process may open files: the oldest idle ones make room for new ones
    idle = []
    try:
        for _ in range(OPEN_FILES + 44):
            idle.append(hardened.socket())
        connection = http.client.HTTPConnection("127.0.0.1", hardened.port, timeout=20)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        for sock in idle:
            sock.close()
    log = hardened.log_text()
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
    assert sum("logged once" in line for line in log.splitlines()) <= 3, log[-3000:]


def test_oversized_bodies_are_refused_before_they_are_read(hardened):
    limit = 64 * 64 + 64 * 1024  # the default for --max-prompt-tokens 64
    with hardened.socket() as sock:  # a Content-Length over the limit: refused at once, the body not awaited
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300000000\r\n\r\n")
        sock.settimeout(20)
        answer = _answer(sock)
        assert answer.status_code == 413, answer.text
        assert f"{limit:,} bytes" in answer.json()["error"]["message"] and "--max-body-bytes" in answer.text
    with hardened.socket() as sock:  # a chunked body: refused once it grows past the limit
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"prompt": "' + b"x" * 8180
        for _ in range(limit // len(chunk) + 1):  # just past the limit: the server reads all that is sent
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        sock.settimeout(20)
        answer = _answer(sock)
        assert answer.status_code == 413 and "--max-body-bytes" in answer.json()["error"]["message"]


# --------------------------------------------------------------------------------------------------
# In this process: values at the edges, seeds, fields and echoes, keys and Host headers


@pytest.fixture(scope="module")
def tiny(model_folder):
    """The test model and its tokenizer, loaded in this process."""
    return AutoModelForCausalLM.from_pretrained(model_folder).eval(), AutoTokenizer.from_pretrained(model_folder)


def _app(tiny, **options):
    """A test client of an in-process server of ``tiny`` named "tiny" (its own queue: use it in a with block)."""
    from starlette.testclient import TestClient

    return TestClient(serve.build_app(serve.ServedModel(*tiny, "tiny"), **options), base_url="http://127.0.0.1")


def _complete(app, stream=False, **body):
    """(status, text or error message) of one completion; a stream's text joined from its events."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, **body}
    if not stream:
        answer = app.post("/v1/completions", json=body)
        payload = answer.json()
        return answer.status_code, payload["choices"][0]["text"] if answer.status_code == 200 else payload["error"][
            "message"]
    with app.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
        if answer.status_code != 200:
            answer.read()
            return answer.status_code, answer.json()["error"]["message"]
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return 200, "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])


def test_values_at_the_edges_are_answered_before_the_stream_starts(tiny, greedy_text):
    with _app(tiny) as app:
        # a temperature below 1e-5 decodes greedily (not a 500 from probabilities of inf and nan)
        for stream in (False, True):
            assert _complete(app, stream, temperature=1e-300) == (200, greedy_text[0])
        # seeds: what torch takes, -2**63 to 2**64 - 1; a seed out of it is the same 422, streaming or not
        for stream in (False, True):
            status, message = _complete(app, stream, seed=2**64, temperature=1)
            assert status == 422 and "seed" in message
        assert _complete(app, False, seed=-1, temperature=1) == _complete(app, True, seed=-1, temperature=1)
        assert _complete(app, False, seed=2**64 - 1, temperature=1)[0] == 200
    served = serve.ServedModel(*tiny, "tiny")

    def refuses(*args, **kwargs):
        raise ValueError("the model cannot take this prompt")

    served.generate = refuses  # what generate() refuses before the first token: a status code, streaming or not
    from starlette.testclient import TestClient

    with TestClient(serve.build_app(served), base_url="http://127.0.0.1") as app:
        for stream in (False, True):
            assert _complete(app, stream, temperature=0) == (400, "the model cannot take this prompt")


def test_one_requests_seed_does_not_set_anothers_sampling(tiny):
    with _app(tiny) as app:
        seeded, unseeded = set(), set()
        for _ in range(3):
            seeded.add(_complete(app, seed=1234, temperature=1.0))
            unseeded.add(_complete(app, temperature=1.0))
        assert len(seeded) == 1  # a seed reproduces its text
        assert len(unseeded) == 3, unseeded  # and leaves the next request's sampling alone
        assert _complete(app, True, seed=1234, temperature=1.0) in seeded  # streamed or not


def test_string_fields_are_bounded_and_echoes_are_cut(tiny):
    with _app(tiny) as app:
        for field, value in (("model", "m" * 100_000), ("user", "u" * 300)):
            answer = app.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, field: value})
            assert answer.status_code == 422 and field in answer.json()["error"]["message"]
            assert len(answer.text) < 500
        answer = app.post("/v1/completions", json={"model": "m" * 250, "prompt": PROMPT})  # within the bound
        assert answer.status_code == 404 and "serves 'tiny'" in answer.text and len(answer.text) < 500
        answer = app.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "x" * 100_000: 1})
        assert answer.status_code == 422 and "not implemented" in answer.text and len(answer.text) < 500


def test_an_api_key_guards_every_endpoint_but_health(tiny):
    with _app(tiny, api_key="s3cret") as app:
        assert app.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            answer = app.get("/v1/models", headers=headers)
            assert answer.status_code == 401 and "Authorization: Bearer" in answer.json()["error"]["message"]
            assert app.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT},
                            headers=headers).status_code == 401
        assert app.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert _complete(app, temperature=0, max_tokens=2)[0] == 401
        answer = app.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                          headers={"Authorization": "Bearer s3cret"})
        assert answer.status_code == 200


def test_a_loopback_server_answers_only_its_own_host_names(tiny, client):
    with _app(tiny, check_host=True) as app:
        for host in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST"):
            assert app.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example:80"):
            answer = app.get("/v1/models", headers={"Host": host})
            assert answer.status_code == 421 and "Host" in answer.json()["error"]["message"], host
    # the server bound to 127.0.0.1 checks it
    parts = urllib.parse.urlsplit(str(client.base_url))
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("GET", "/v1/models", headers={"Host": "rebound.example"})
    assert connection.getresponse().status == 421
    connection.close()


def test_no_docs_and_a_folder_is_served_under_its_own_name(tiny, model_folder):
    with _app(tiny) as app:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert app.get(path).status_code == 404, path
    parser = serve.build_parser()
    served = serve.load(parser.parse_args([str(model_folder), "--device", "cpu"]), parser)
    assert served.name == model_folder.name  # not its path


def test_a_public_bind_without_a_key_warns_and_the_key_comes_from_the_environment(tiny, monkeypatch, capfd):
    started = []

    class NotRun:
        def __init__(self, config, served, *args):
            started.append(config)

        def run(self):
            pass

    monkeypatch.setattr(serve, "_Server", NotRun)
    monkeypatch.setattr(serve, "load", lambda args, parser: serve.ServedModel(*tiny, "tiny"))
    monkeypatch.delenv("HF_RESOLVENT_API_KEY", raising=False)
    assert serve.main(["unused", "--host", "0.0.0.0"]) == 0
    assert "without an API key" in capfd.readouterr().err
    monkeypatch.setenv("HF_RESOLVENT_API_KEY", "from-the-environment")
    assert serve.main(["unused", "--host", "0.0.0.0"]) == 0
    assert "without an API key" not in capfd.readouterr().err
    gate = started[-1].app
    assert gate.api_key == b"from-the-environment" and not gate.check_host
    assert serve.main(["unused"]) == 0 and started[-1].app.check_host  # loopback: Host checked


# --------------------------------------------------------------------------------------------------
# Folders that cannot be served: hostile pickled weights, no tokenizer


class _RunsACommand:
    """A pickled object whose unpickling would run a shell command (what a hostile pytorch_model.bin holds)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _folder_with(model_folder, tmp_path, kind: str):
    """A folder of ``kind`` ("resolvent" or "gpt2") with the test tokenizer and no weights yet."""
    folder = tmp_path / kind
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_folder / name, folder / name)
    if kind == "resolvent":
        shutil.copy(model_folder / "config.json", folder / "config.json")
    else:
        from transformers import GPT2Config

        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64, bos_token_id=0,
                   eos_token_id=0).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["resolvent", "gpt2"])
def test_a_pickled_weights_file_that_names_code_stops_with_one_message(model_folder, tmp_path, capsys, kind):
    folder = _folder_with(model_folder, tmp_path, kind)
    marker = tmp_path / "the-payload-ran"
    torch.save({"lm_head.weight": torch.zeros(2, 2), "x": _RunsACommand(f"touch {marker}")},
               folder / "pytorch_model.bin")
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(folder), "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin is a pickle that holds more than tensors" in err and "not safe to load" in err, err
    assert "Traceback" not in err and "UnpicklingError" not in err and "weights_only=False" not in err.split(
        "python -c")[0], err
    assert not marker.exists()


def test_a_folder_without_a_tokenizer_says_how_to_add_one(model_folder, tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_folder / name, folder / name)
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(folder), "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "tokenizer.save_pretrained(" in err, err
    assert "sentencepiece" not in err and "Traceback" not in err, err
