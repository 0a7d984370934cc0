"""Concurrent requests through vLLM's OpenAI server against the library's own server (python -m hf_resolvent.serve,
which generates one request at a time): tokens per second and time to first token, per mixer.

Run it where vLLM is installed (docs/serving.md: an environment of its own). For each mixer it saves a small model
(random weights, a BPE tokenizer trained on the standard library's text) under --out, then for each server in turn
starts it on a loopback port, waits for it, sends --concurrency batches of streamed completion requests (the same
prompts, greedy, --max-tokens each, never stopped early: the model has no end token, and vLLM is told to ignore
its tokenizer's), and stops it. Time to first token is from sending a request to its first streamed text; tokens
per second is the batch's tokens over the batch's wall time. Both servers get the same threads (OMP_NUM_THREADS).

    python scripts/bench/bench_vllm.py --out runs/bench/vllm

writes results.json and vllm.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT_WORDS = ("The function returns a new list of the values in the order they were given, and raises an error "
                "when the input holds an item that is not a number. ").split()


def save_models(out: Path, mixers: list[str], width: int, layers: int, heads: int, vocab: int, context: int
                ) -> dict[str, Path]:
    import torch

    from hf_resolvent import ResolventConfig, ResolventForCausalLM
    from hf_resolvent.training.data import train_bpe_tokenizer
    from hf_resolvent.training.data.corpus import stdlib_corpus

    tokenizer = train_bpe_tokenizer([doc["text"] for doc in stdlib_corpus(max_docs=200)], vocab_size=vocab)
    folders = {}
    for mixer in mixers:
        torch.manual_seed(0)
        config = ResolventConfig(vocab_size=len(tokenizer), n_positions=context, n_embd=width, n_layer=layers,
                                 n_head=heads, mixer=mixer, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        folder = out / "models" / mixer.replace(":", "_")
        ResolventForCausalLM(config).eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[mixer] = folder
    return folders, tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a loopback port, stopped on exit (its output goes to a log file under --out)."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict, timeout: float):
        self.port, self.log_path, self.timeout = port, log, timeout
        self.log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self):
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at startup:\n{self.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health in {self.timeout:.0f} s: {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


def one_request(client, prompt: str, max_tokens: int, extra: dict) -> dict:
    sent = time.perf_counter()
    first = None
    reason = None
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body=extra)
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        if first is None and choice.text:
            first = time.perf_counter()
        reason = choice.finish_reason or reason
    done = time.perf_counter()
    if reason != "length":
        raise RuntimeError(f"a request ended with finish_reason={reason!r}, not after its max_tokens")
    return {"ttft_s": first - sent, "total_s": done - sent}


def measure(port: int, prompts: list[str], max_tokens: int, extra: dict, rounds: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
    one_request(client, prompts[0], 4, extra)  # warm-up: first-call costs (kernel builds, allocations)
    walls, ttfts = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: one_request(client, p, max_tokens, extra), prompts))
        walls.append(time.perf_counter() - start)
        ttfts += [r["ttft_s"] for r in results]
    wall = statistics.median(walls)
    ttfts.sort()
    return {"requests": len(prompts), "max_tokens": max_tokens, "rounds": rounds, "wall_s": walls,
            "tokens_per_s": len(prompts) * max_tokens / wall, "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "ttft_max_s": ttfts[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/vllm", help="folder for results.json, the plot, models and logs")
    p.add_argument("--mixers", default="exp2:ce,attention")
    p.add_argument("--servers", default="vllm,hf_resolvent.serve", help="which of the two servers to measure")
    p.add_argument("--concurrency", default="1,16", help="requests sent at once, one batch per value")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="batches per setting; the median wall time counts")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024, help="n_positions, and vLLM's max_model_len")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of both servers")
    p.add_argument("--startup-timeout", type=float, default=300)
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mixers = args.mixers.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    folders, tokenizer = save_models(out, mixers, args.width, args.layers, args.heads, args.vocab, args.context)
    words = (PROMPT_WORDS * (args.prompt_tokens // 10 + 2))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    servers = {
        "vllm": lambda folder, port: [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "bench", "--dtype", "float32", "--max-model-len",
            str(args.context), "--max-num-seqs", str(max(concurrency))],
        "hf_resolvent.serve": lambda folder, port: [
            sys.executable, "-m", "hf_resolvent.serve", str(folder), "--port", str(port), "--served-model-name",
            "bench", "--dtype", "float32", "--max-queue", str(max(concurrency)), "--log-level", "warning"],
    }
    extras = {"vllm": {"ignore_eos": True}, "hf_resolvent.serve": {}}
    rows = []
    for mixer in mixers:
        # prompts of --prompt-tokens tokens, each from a different word on so that no two are the same
        prompts = []
        for i in range(max(concurrency)):
            ids = tokenizer(" ".join(words[i % 10:]))["input_ids"][:args.prompt_tokens]
            prompts.append(tokenizer.decode(ids))
        for name in args.servers.split(","):
            command = servers[name]
            port = free_port()
            log = out / f"{name}-{mixer.replace(':', '_')}.log"
            with Server(command(folders[mixer], port), port, log, env, args.startup_timeout):
                for c in concurrency:
                    result = measure(port, prompts[:c], args.max_tokens, extras[name], args.rounds)
                    rows.append({"mixer": mixer, "server": name, "concurrency": c, **result})
                    print(f"{mixer:10s} {name:20s} x{c:<3d} {result['tokens_per_s']:8.1f} tok/s  ttft median "
                          f"{result['ttft_median_s']:.3f} s  p90 {result['ttft_p90_s']:.3f} s", flush=True)
    import torch
    import vllm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    report = {
        "commit": commit,
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "model": {"width": args.width, "layers": args.layers, "heads": args.heads, "vocab": len(tokenizer),
                  "context": args.context, "dtype": "float32", "weights": "random (speed does not depend on them)"},
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__},
        "results": rows,
    }
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n| mixer | server | concurrent requests | tokens/s | TTFT median (s) | TTFT p90 (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['server']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_median_s']:.3f} | {r['ttft_p90_s']:.3f} |")
    plot(rows, out / "vllm.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(r["concurrency"] for r in rows)
    shown = [r for r in rows if r["concurrency"] == top]
    labels = [f"{r['mixer']}\n{r['server']}" for r in shown]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].bar(labels, [r["tokens_per_s"] for r in shown], color=["C0" if r["server"] == "vllm" else "C1"
                                                                   for r in shown])
    axes[0].set_ylabel("tokens / s")
    axes[1].bar(labels, [r["ttft_median_s"] for r in shown], color=["C0" if r["server"] == "vllm" else "C1"
                                                                    for r in shown])
    axes[1].set_ylabel("time to first token, median (s)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{top} concurrent requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
