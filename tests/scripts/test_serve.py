"""hf_resolvent.serve: a saved model behind an OpenAI-compatible API (``transformers serve`` cannot load it), used
with the ``openai`` client: a completion and a streamed completion give ``model.generate``'s greedy text; what the
server does not implement is refused by name; a folder that is not a model stops the command with one message."""

from __future__ import annotations

import http.client
import json
import os
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_ready(proc: subprocess.Popen, url: str, log) -> None:
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            with no_proxy.open(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise AssertionError(f"the server did not answer {url} within {READY_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def _start(model_folder, log, *flags):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hf_resolvent.serve", str(model_folder), "--host", "127.0.0.1",
                                 "--port", str(port), "--served-model-name", "tiny", "--device", "cpu",
                                 "--log-level", "warning", *flags], env=env, stdout=out, stderr=subprocess.STDOUT)
    _wait_until_ready(proc, f"http://127.0.0.1:{port}/health", log)
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
    answer = _post(limited, prompt="x" * 10_000_000)  # 10 MB: refused before it is tokenized
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


def test_ctrl_c_stops_the_server_during_a_generation(model_folder, tmp_path):
    import signal

    proc, url = _start(model_folder, tmp_path / "server.log", "--max-tokens", str(ENDLESS))
    try:
        stream = _start_endless_stream(url)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


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
