"""hf_resolvent.serve: a saved model behind an OpenAI-compatible API (``transformers serve`` cannot load it), used
with the ``openai`` client: a completion and a streamed completion give ``model.generate``'s greedy text; what the
server does not implement is refused by name; a folder that is not a model stops the command with one message."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
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


@pytest.fixture(scope="module")
def client(model_folder, tmp_path_factory):
    """An OpenAI client of a server on a free loopback port, serving ``model_folder`` under the name "tiny"."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hf_resolvent.serve", str(model_folder), "--host", "127.0.0.1",
                                 "--port", str(port), "--served-model-name", "tiny", "--device", "cpu",
                                 "--log-level", "warning"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_ready(proc, f"http://127.0.0.1:{port}/health", log)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0,
                            http_client=openai.DefaultHttpxClient(trust_env=False))  # no proxy for loopback
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


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
