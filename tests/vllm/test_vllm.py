"""vLLM serves every supported mixer family with the library's own tokens: greedy decoding equals
ResolventForCausalLM.generate() (float32) for a batch of prompts of different lengths, one of them prefilled in
chunks, for requests that arrive while others decode, and again once every slot has been used before; seeded
sampling repeats itself; a model vLLM cannot serve is refused at load, naming the mixers it serves."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
import torch
from servers import free_port, wait_until_ready

MAX_MODEL_LEN = 256  # the models' n_positions (conftest.py)
CHUNK = 32  # max_num_batched_tokens: a longer prompt is prefilled in chunks

# (id, mixer, extra config): each family of the library, hybrids, the short convolution
FAMILIES = [
    ("exp2_ce", "exp2:ce", {}),
    ("square_ce", "square:ce", {}),
    ("exp2_ce_tied", "exp2:ce+tied", {}),
    ("banded", "banded:8", {}),
    ("attention", "attention", {}),
    ("hybrid", ["exp2:ce", "attention"], {}),
    ("windows", ["local_attention:6", "diagonal"], {}),
    ("conv", ["exp2:ce", "banded:4+tied"], {"conv_size": 4}),
    ("hybrid_conv", ["attention", "square:ce"], {"conv_size": 3}),
]

PROMPTS = [
    "def",
    "The quick brown fox",
    "import os\nimport sys\n\ndef main(argv):\n    \"\"\"Parse the arguments, then run the command.\"\"\"\n"
    "    parser = argparse.ArgumentParser(description=__doc__)",  # longer than CHUNK tokens: prefilled in chunks
    "Return a new list",
    "class Queue:",
    "    for key, value in sorted(items.items()):",
]
MAX_TOKENS = [12, 20, 16, 8, 14, 10]  # different lengths: requests finish, and slots free, at different steps
TIE = 1e-4  # a greedy step whose two best logits lie closer than this may go either way with rounding


def make_llm(folder, **overrides):
    from vllm import LLM

    options = dict(model=str(folder), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK,
                   max_num_seqs=4, seed=0)
    options.update(overrides)
    return LLM(**options)


def release(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def reference(folder, tokenizer, prompts, max_tokens) -> list[tuple[list[int], list[float]]]:
    """The library's greedy tokens for each prompt alone, with each step's margin between its two best logits."""
    from hf_resolvent import ResolventForCausalLM

    model = ResolventForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        result = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
        top2 = [score[0].topk(2).values for score in result.scores]
        out.append((result.sequences[0, ids.shape[1]:].tolist(), [float(t[0] - t[1]) for t in top2]))
    return out


def assert_same_tokens(got: list[list[int]], expected, what: str) -> None:
    """vLLM's tokens equal the library's, up to the first step of a near tie (after which the texts may part)."""
    for i, (tokens, (ref, margins)) in enumerate(zip(got, expected)):
        assert len(tokens) == len(ref), f"{what}, prompt {i}: {len(tokens)} tokens, expected {len(ref)}"
        for step, (a, b) in enumerate(zip(tokens, ref)):
            if a != b:
                assert margins[step] < TIE, (f"{what}, prompt {i}, step {step}: vLLM gave {a}, generate() {b} "
                                             f"(margin {margins[step]:.2e}):\n{tokens}\n{ref}")
                break


def greedy(max_tokens):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def staggered(llm, tokenizer, prompts, params, first: int, steps: int) -> list[list[int]]:
    """Tokens of the requests when the first ``first`` are sent, decoded ``steps`` steps, and the others sent
    then, while those decode."""
    engine = llm.llm_engine
    done: dict[str, list[int]] = {}

    def add(i):
        engine.add_request(f"late-{i}", {"prompt_token_ids": tokenizer(prompts[i])["input_ids"]}, params[i])

    def step():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)

    for i in range(first):
        add(i)
    for _ in range(steps):
        step()
    assert len(done) < first, "the first requests finished before the others came: nothing arrived while decoding"
    for i in range(first, len(prompts)):
        add(i)
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish the requests in 120 s"
        step()
    return [done[f"late-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family, mixer, extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_vllm_greedy_tokens_equal_generate(family, mixer, extra, save_model, tokenizer):
    from vllm import SamplingParams

    folder = save_model(mixer, **extra)
    assert len(tokenizer(PROMPTS[2])["input_ids"]) > CHUNK  # its prefill takes several steps
    expected = reference(folder, tokenizer, PROMPTS, MAX_TOKENS)
    llm = make_llm(folder)
    try:
        # six requests, four at a time: the last two take the slots the first ones leave, mid-decoding
        batch = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)]
        assert_same_tokens(batch, expected, f"{family}, one batch")
        # the same slots again, holding the states the requests above left in them
        again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[::-1], greedy(MAX_TOKENS[::-1]),
                                                                     use_tqdm=False)]
        assert_same_tokens(again[::-1], expected, f"{family}, slots reused")
        late = staggered(llm, tokenizer, PROMPTS, greedy(MAX_TOKENS), first=2, steps=5)
        assert_same_tokens(late, expected, f"{family}, requests arriving while others decode")
        # seeded sampling: the same tokens alone and beside other requests
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
        alone = llm.generate([PROMPTS[1]], [seeded], use_tqdm=False)[0].outputs[0].token_ids
        beside = llm.generate(PROMPTS[:3], [greedy([9])[0], seeded, greedy([5])[0]], use_tqdm=False)
        assert list(beside[1].outputs[0].token_ids) == list(alone)
    finally:
        release(llm)


@pytest.mark.parametrize("mixer", ["dense", ["exp2:ce", "exp2"]], ids=["dense", "plain_exp2"])
def test_a_model_that_keeps_every_position_is_refused_at_load(mixer, save_model):
    folder = save_model(mixer)
    with pytest.raises(Exception, match="vLLM cannot serve this resolvent model") as err:
        make_llm(folder)
    message = str(err.value)
    assert "exp2:ce" in message and "banded:w" in message and "attention" in message  # what it serves


def test_the_openai_server_serves_a_saved_folder(save_model, tokenizer, tmp_path):
    """vLLM's OpenAI server loads the folder through the plugin (no code of the user's) and completes greedily as
    generate() does, a chat of a base model's tokenizer included (our server's plain template)."""
    from openai import OpenAI

    folder = save_model(["exp2:ce", "attention"])
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as a user runs it: the engine in a process of its own
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port",
               str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--served-model-name", "tiny"]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_ready(server, f"http://127.0.0.1:{port}/health", tmp_path / "server.log", timeout=180)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
        expected = reference(folder, tokenizer, [PROMPTS[1]], [12])
        text = tokenizer.decode(expected[0][0])
        assert completion.choices[0].text == text
        # a chat, through the plain template of our own server (the tokenizer has none)
        from hf_resolvent.serve import PLAIN_CHAT_TEMPLATE

        assert not getattr(tokenizer, "chat_template", None)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def main"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
        prompt = tokenizer.apply_chat_template(messages, chat_template=PLAIN_CHAT_TEMPLATE.read_text(), tokenize=False)
        assert prompt == "System: Be brief.\nUser: def main\nAssistant:"
        expected = reference(folder, tokenizer, [prompt], [10])
        # (vLLM holds back the bytes of a character that the last token leaves incomplete; decode() gives U+FFFD)
        assert chat.choices[0].message.content == tokenizer.decode(expected[0][0]).rstrip("\ufffd")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


def test_the_vllm_example_of_the_serving_docs_runs(save_model, capsys):
    """docs/serving.md's vLLM example (fenced `py`: the docs' Python blocks run in the environment without vLLM),
    run as written on a tiny model in place of runs/tiny."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    (block,) = re.findall(r"^```py\n(.*?)^```", text, flags=re.S | re.M)
    assert "runs/tiny" in block
    names: dict = {}
    try:
        exec(block.replace("runs/tiny", str(save_model("exp2:ce"))), names)
    finally:
        if "llm" in names:
            release(names.pop("llm"))
    assert len(capsys.readouterr().out.strip().splitlines()) >= 2  # the two completions
