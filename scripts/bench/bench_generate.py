"""End-to-end generation as a user runs it: time to first token, decode speed, peak memory and cache bytes.

Every measurement is one call of ``model.generate(input_ids, attention_mask=ones, max_new_tokens=N,
min_new_tokens=N, do_sample=False)`` (greedy, exactly N new tokens) on a random prompt of n tokens, for

- ``gpt2``: ``transformers.GPT2LMHeadModel`` (SDPA attention, its ``DynamicCache``),
- ``mamba2``: ``transformers.Mamba2ForCausalLM``, the recurrent model a user might pick instead. On CPU it
  runs the PyTorch path of ``transformers`` (``mamba_ssm`` / ``causal_conv1d`` are CUDA-only: chunked scan for
  the prefill, one state update per token). Config: same width, layers and vocabulary, ``expand`` 2 (inner
  width 2 x width), heads of ``min(64, 2 * width / heads)`` channels (8 heads of 64 at width 256, the
  Mamba-2 papers' head width), ``state_size`` 128 (``--mamba-state``), one B/C group, conv kernel 4, chunk
  256, tied embeddings as GPT-2's. A Mamba-2 block has no MLP (that is the architecture), so it has fewer
  parameters than the others at the same width; the ``params`` column says how many.
- one ``hf_resolvent.ResolventForCausalLM`` per mixer of ``scripts/bench/bench_decode.py``'s ``MIXERS``,
- ``<mixer> compiled`` (``exp2:ce`` and ``dense`` by default): the same model decoding through a static cache
  (``ResolventCache(config, max_cache_len=n + N)``, what ``cache_implementation="static"`` makes) with the
  decode step that ``generate()`` compiles itself (``compile_config``: fullgraph, inductor); one graph for all
  the tokens of a run, compiled during the warm-up (which uses a cache of the same size), so not timed,
- ``<model> chunked`` (``exp2:ce`` by default): the same model, prompt in chunks of ``--prefill-chunk`` tokens
  (``generate(prefill_chunk_size=...)``, ``transformers``' own chunked prefill; a resolvent model runs each
  chunk after the first in parallel from its cache), which holds one chunk's activations at a time,

all with the same width, layers, heads and vocabulary (defaults as bench_decode: width 256, 4 layers, 4
heads, vocab 50257, float32), built with random weights (seed 0) from configs, as bench_decode builds them.

Measurement: every (model, prompt length, batch) runs in its own child process, forked from this one after
the imports (so a child starts in milliseconds and holds what a fresh ``import torch, transformers,
hf_resolvent`` process holds), with the same torch thread count (``--threads``, default 1). The child builds
the model, warms up with a 16-token generate, then runs the timed generate once with a logits processor that
records the time of each step (it is called right after each step's forward, so it adds nothing measurable):

- ``ttft_s``: from calling ``generate`` to the first step's logits: ``generate``'s set-up and the prefill
  forward over the n prompt tokens with ``logits_to_keep=1`` (as ``generate`` calls it);
- ``decode_ms_per_token``: (time of step N - time of step 1) / (N - 1): the N - 1 one-token forwards and
  ``generate``'s own per-step work (token choice, stopping checks, cache and mask updates);
  ``decode_tokens_per_s`` is batch x 1000 / that; ``decode_ms_median`` is the median single step;
- ``peak_rss_mib``: the child's peak resident memory (``VmHWM``: model, prompt, prefill activations, cache),
  ``model_rss_mib`` its resident memory after building the model and warming up; the table also gives their
  difference, the peak above the model: what prompt, activations and cache add, apart from the process (PyTorch,
  ``transformers``, the weights) that every model pays;
- ``cache_bytes``: bytes held by the cache ``generate`` returns (``ResolventCache.nbytes()``; for GPT-2 and
  Mamba2 the sum of the tensors their ``DynamicCache`` layers hold);
- ``load_avg_1min``: the machine's load average after the run, to tell a run slowed by other processes.

Batched decode: the same at ``--batch-context`` tokens (4096) for batches ``--batches`` (1 8 32);
``decode_tokens_per_s`` counts the tokens of all sequences. A batch-1 run at a context of the sweep is reused.

Nothing hangs: a child gets ``--max-seconds`` (1200) and is killed past it; a child that would need more than
``--max-gib`` of address space fails its allocation and reports it; a model that timed out or ran out of
memory at a context is not run at longer ones, nor where the growth of its earlier runs predicts that it
would not fit. Each of these is a row with ``"skipped": "<why>"``. A crash is a row with ``"error"`` (exit 1).
The models run round-robin per context (contexts outer), so that load from other processes hits all alike;
single runs on a shared machine are noisy: compare ratios. On the 2-core development machine (shared with
other jobs) the prefill of 8192 tokens took 13 s for GPT-2 and Mamba2, 18 s for dense, 5-6 s for exp2:ce and
square:ce; GPT-2, attention and dense grow about quadratically (some 64 times that at 64k), so a full run
takes hours. ``--quick`` took under 2 minutes.

Prompts to a million tokens (``--million``): 64k, 128k, 256k, 512k and 1M (2^20) tokens, 32 new tokens, no
batched runs, ``--max-seconds`` 600, for GPT-2 and ``attention`` with the prompt at once (their fastest prefill;
in chunks it took 1.3 and 1.5 times as long at 16k) and the cache-efficient mixers with the prompt in chunks of
``--prefill-chunk`` (1024): ``exp2:ce``, ``exp2:ce+tied``, ``square:ce``, ``square:ce+tied``. The 64k runs give the
skip prediction two points per model, so a model whose prefill grows as n^2 is skipped where its next prompt
would pass ``--max-seconds``, not killed after it. Every row of a model whose cache keeps every position (GPT-2,
attention, dense) carries ``cache_bytes_computed``: what its cache holds after the run, from the config (keys and
values per token and layer, float32), measured or not; at 1M tokens GPT-2's is 8.0 GiB. ``growth`` in the JSON (and
a printed table) gives, per model and pair of consecutive measured prompt lengths, the exponent p of n^p that
time to first token, decode ms/token and the peak above the model grew with.

Chunks of 1024 tokens: the prefill's peak is one chunk's activations (45 MiB above the model for exp2:ce from
16k to 64k; 4096 tokens add 100 MiB at 256k and were not faster there). What a chunk costs beyond its own tokens
is ``generate()`` slicing the attention mask and the model checking it against the cache, O(tokens seen): 5 ms at
1M tokens, against some 110 ms of compute per chunk of 1024 for exp2:ce.

Usage::

    python scripts/bench/bench_generate.py --out runs/bench/generate.json                  # 1k ... 64k, 128 new tokens
    python scripts/bench/bench_generate.py --out runs/bench/generate.json --with-128k      # and 128k
    python scripts/bench/bench_generate.py --out runs/bench/generate_quick.json --quick    # under 3 minutes
    python scripts/bench/bench_generate.py --out runs/bench/million.json --million         # 64k ... 1M tokens

Writes ``{"rows": [{"model", "context", "batch", "new_tokens", "ttft_s", "decode_ms_per_token", ...}, ...],
"settings": {...}}``, a PNG next to the JSON (decode ms/token and time to first token against the context)
and prints tables with the ratios to GPT-2.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import re
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList, Mamba2Config, Mamba2ForCausalLM

import hf_resolvent as hr
from hf_resolvent.cache_resolvent import ResolventCacheLayer
from hf_resolvent.modeling_resolvent import CACHE_NAME  # the cache's argument name in this transformers
from hf_resolvent.training import cli
from hf_resolvent.training.metrics import log_axes, write_result
from hf_resolvent.training.models import build_model

# The mixers of scripts/bench/bench_decode.py (the test checks that the two lists agree).
MIXERS = ("attention", "local_attention:256", "dense", "banded:64", "diagonal", "exp2", "exp2:ce", "square",
          "square:ce", "exp2:ce+tied")
GPT2, MAMBA2 = "gpt2", "mamba2"
COMPILED = " compiled"  # suffix: the mixer's compiled decode step on a static cache
CHUNKED = " chunked"  # suffix: the prompt in chunks of --prefill-chunk tokens
CONTEXTS = (1024, 4096, 16384, 32768, 65536)
QUICK = dict(contexts=[512, 2048], new_tokens=16,
             models=[GPT2, MAMBA2, "attention", "dense", "exp2:ce", "exp2:ce" + COMPILED, "exp2:ce" + CHUNKED],
             batches=[1, 8], batch_context=1024)
MILLION = dict(contexts=[2**16, 2**17, 2**18, 2**19, 2**20], new_tokens=32,
               models=[GPT2, "attention", "exp2:ce" + CHUNKED, "exp2:ce+tied" + CHUNKED, "square:ce" + CHUNKED,
                       "square:ce+tied" + CHUNKED],
               batches=[], max_seconds=600.0)
WARMUP_TOKENS = 16
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (a PNG with the same stem goes next to it)")
    p.add_argument("--quick", action="store_true",
                   help="n = 512 and 2048, 16 new tokens, gpt2 mamba2 attention dense exp2:ce (also compiled and "
                        "chunked), batch 1 and 8 at 1024 "
                        "(explicit options still win)")
    p.add_argument("--million", action="store_true",
                   help="n = 64k, 128k, 256k, 512k and 1M, 32 new tokens, no batched runs, --max-seconds 600; gpt2 "
                        "and attention, and exp2:ce, exp2:ce+tied, square:ce, square:ce+tied chunked (explicit "
                        "options still win)")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help=f"prompt lengths (default {CONTEXTS})")
    p.add_argument("--with-128k", action="store_true", help="add prompts of 131072 tokens")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    p.add_argument("--models", nargs="+", default=None,
                   help=f"'{GPT2}', '{MAMBA2}', resolvent mixer specs, '<mixer>{COMPILED}' and '<model>{CHUNKED}' "
                        "(default: gpt2 mamba2, bench_decode's mixers, exp2:ce and dense compiled, exp2:ce chunked)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per chunk of the chunked models")
    p.add_argument("--batches", type=int, nargs="*", default=None,
                   help="batch sizes of the batched-decode runs (default 1 8 32; none: skip them)")
    p.add_argument("--batch-context", type=int, default=None, help="prompt length of the batched runs (4096)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--mamba-state", type=int, default=128, help="Mamba2 state_size")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every child")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock limit of one child (default 1200; 600 with --million)")
    p.add_argument("--max-gib", type=float, default=None,
                   help="memory one child may use (default: 80%% of MemAvailable at start)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick and args.million:
        p.error("--quick and --million are two presets: give one of them")
    preset = QUICK if args.quick else MILLION if args.million else {}
    everything = [GPT2, MAMBA2, *MIXERS, "exp2:ce" + COMPILED, "dense" + COMPILED, "exp2:ce" + CHUNKED]
    for key, full in (("contexts", list(CONTEXTS)), ("new_tokens", 128), ("models", everything),
                      ("batches", [1, 8, 32]), ("batch_context", 4096), ("max_seconds", 1200.0)):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, full))
    shape = dict(width=args.width, layers=args.layers, heads=args.heads, vocab=args.vocab)
    for name in args.models:  # a mixer spec that does not parse fails here, not in every child
        try:
            kv_cache_bytes(name, shape, 1)
        except ValueError as e:
            p.error(f"--models {name!r}: {e} (or '{GPT2}', '{MAMBA2}', with '{COMPILED.strip()}' or "
                    f"'{CHUNKED.strip()}' after a space)")
    if args.with_128k and 131072 not in args.contexts:
        args.contexts = [*args.contexts, 131072]
    args.contexts = sorted(set(args.contexts))
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode speed is measured between the first and the last)")
    if args.max_gib is None:
        args.max_gib = round(0.8 * mem_available() / 2**30, 2)
    cli.check(p, files=[("--out", args.out)])
    return args


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (total physical memory where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def proc_status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM, VmSize); ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ----------------------------------------------------------------------------------------------- models


def mamba2_config(s: dict) -> Mamba2Config:
    inner = 2 * s["width"]
    head_dim = min(64, inner // s["heads"])
    return Mamba2Config(vocab_size=s["vocab"], hidden_size=s["width"], num_hidden_layers=s["layers"], expand=2,
                        num_heads=inner // head_dim, head_dim=head_dim, state_size=s["mamba_state"], n_groups=1,
                        conv_kernel=4, chunk_size=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=0,
                        eos_token_id=0)


def build(name: str, s: dict, n_positions: int) -> torch.nn.Module:
    """GPT-2, Mamba2 or a resolvent model at the shape of settings ``s``, random weights of seed ``s['seed']``."""
    torch.manual_seed(s["seed"])
    if name == MAMBA2:
        return Mamba2ForCausalLM(mamba2_config(s)).eval()
    shape = dict(n_positions=n_positions, n_embd=s["width"], n_layer=s["layers"], n_head=s["heads"],
                 n_inner=4 * s["width"])
    cfg = {"type": "gpt2" if name == GPT2 else "resolvent", "preset": "tiny", "mixer": name, "overrides": shape}
    return build_model(cfg, s["vocab"], n_positions, eos_token_id=0).eval()


def kv_cache_bytes(name: str, s: dict, tokens: int, batch: int = 1) -> int | None:
    """Bytes the float32 cache of model ``name`` holds after ``tokens`` tokens, computed from its config, for the
    models whose cache keeps every position (GPT-2, and resolvent models all of whose layers keep every position:
    attention, dense, plain f-patterns); None for the others, whose cache does not grow as one row per token.

    GPT-2 keeps a key and a value of ``width`` per token and layer; a resolvent layer keeps its state's rows
    (``ResolventCacheLayer.row_names``: keys and values for attention, both channels' keys, the input and the output
    for resolvent patterns), ``heads x head_dim`` each, and the int64 position of each row."""
    base = name.removesuffix(CHUNKED).removesuffix(COMPILED)
    if base == GPT2:
        return 2 * s["layers"] * tokens * s["width"] * 4 * batch
    if base == MAMBA2:
        return None
    config = hr.ResolventConfig.from_preset("tiny", mixer=base, n_embd=s["width"], n_layer=s["layers"],
                                            n_head=s["heads"], n_inner=4 * s["width"], vocab_size=s["vocab"])
    total = 0
    for spec in config.layer_mixers:
        layer = ResolventCacheLayer(spec["pattern"], spec["tied"])
        if not layer.keeps_every_position:
            return None
        total += tokens * (len(layer.row_names) * config.n_head * config.head_dim * 4 + 8)
    return total * batch


def cache_bytes(cache) -> int:
    """Bytes a generation cache holds: ``nbytes()`` of a ResolventCache, else every distinct tensor of its layers."""
    if isinstance(cache, hr.ResolventCache):
        return cache.nbytes()
    seen: dict[int, int] = {}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            seen[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for layer in getattr(cache, "layers", []):
        walk(vars(layer))
    return sum(seen.values())


class StepClock(LogitsProcessor):
    """Records ``time.perf_counter()`` each time generate() hands it a step's logits; changes nothing."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate(model, ids: torch.Tensor, new_tokens: int, clock: StepClock | None = None, static_len: int = 0,
             prefill_chunk: int | None = None):
    """Greedy generate() of exactly ``new_tokens``; with ``static_len``, on a static cache of that many tokens with
    the decode step compiled by generate() itself; with ``prefill_chunk``, the prompt in chunks of that many tokens."""
    procs = LogitsProcessorList([clock] if clock is not None else [])
    compiled = {} if prefill_chunk is None else {"prefill_chunk_size": prefill_chunk}
    if static_len:
        config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
        config._compile_all_devices = True  # transformers' switch for compiling on a CPU
        compiled.update({CACHE_NAME: hr.ResolventCache(model.config, max_cache_len=static_len),
                         "compile_config": config})
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, logits_processor=procs, pad_token_id=0,
                          eos_token_id=0, return_dict_in_generate=True, **compiled)


def measure(job: dict) -> dict:
    """One (model, context, batch) in this (child) process: build, warm up, one timed generate."""
    s, name, n, batch, new = job["settings"], job["model"], job["context"], job["batch"], job["new_tokens"]
    torch.set_num_threads(s["threads"])
    transformers.utils.logging.set_verbosity_error()  # Mamba2's "falling back to PyTorch" notes, once per child
    model = build(name.removesuffix(CHUNKED).removesuffix(COMPILED), s, n_positions=n + new + 8)
    # the warm-up compiles the step for the timed run's size
    static_len = n + new if name.removesuffix(CHUNKED).endswith(COMPILED) else 0
    chunk = s["prefill_chunk"] if name.endswith(CHUNKED) else None
    gen = torch.Generator().manual_seed(s["seed"] + n + batch)
    with torch.no_grad():
        warm = torch.randint(1, s["vocab"], (batch, min(n, WARMUP_TOKENS)), generator=gen)
        t0 = time.perf_counter()
        generate(model, warm, 2, static_len=static_len, prefill_chunk=chunk)
        warm_s = time.perf_counter() - t0
        del warm
        model_rss = proc_status_kib("VmRSS") * 1024
        ids = torch.randint(1, s["vocab"], (batch, n), generator=gen)
        clock = StepClock()
        t0 = time.perf_counter()
        out = generate(model, ids, new, clock, static_len=static_len, prefill_chunk=chunk)
        total = time.perf_counter() - t0
    if tuple(out.sequences.shape) != (batch, n + new) or len(clock.times) != new:
        raise RuntimeError(f"generate gave sequences {tuple(out.sequences.shape)} and {len(clock.times)} steps, "
                           f"expected {(batch, n + new)} and {new}")
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    decode = (clock.times[-1] - clock.times[0]) / (new - 1)
    # Linux sums its RSS counters per CPU lazily, so VmHWM read now can be a few pages under the VmRSS read before
    # the prompt (seen: 16 KiB): the peak is at least every resident size observed
    peak_rss = max(proc_status_kib("VmHWM") * 1024, model_rss)
    return dict(model=name, context=n, batch=batch, new_tokens=new, ttft_s=clock.times[0] - t0, total_s=total,
                decode_ms_per_token=1e3 * decode, decode_ms_median=1e3 * statistics.median(steps),
                decode_tokens_per_s=batch / decode, cache_bytes=cache_bytes(out[CACHE_NAME]),
                peak_rss_mib=peak_rss / MIB, model_rss_mib=model_rss / MIB,
                params=sum(p.numel() for p in model.parameters()), threads=torch.get_num_threads(),
                warmup_s=warm_s)


def _child(job: dict, conn) -> None:
    try:
        limit = int(job["max_bytes"]) + proc_status_kib("VmSize") * 1024  # on top of what the imports mapped
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        conn.send(("ok", measure(job)))
    except (MemoryError, RuntimeError) as e:
        text = str(e)
        if isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
            asked = re.search(r"allocate (\d+) bytes", text)
            conn.send(("oom", f"an allocation of {int(asked[1]) / MIB:.0f} MiB failed" if asked else text[:200]))
        else:
            conn.send(("error", traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as a row
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_child(job: dict, max_seconds: float) -> tuple[str, object, float]:
    """Run :func:`measure` in a forked child; (status, result or message, wall seconds). Kills it at the limit."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(job, send), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    send.close()
    status, payload = "error", None
    if recv.poll(max_seconds):
        try:
            status, payload = recv.recv()
        except EOFError:  # the child died without a word
            pass
    elif proc.is_alive():
        proc.kill()
        status, payload = "timeout", f"timeout: killed after --max-seconds {max_seconds:g} s"
    wall = time.perf_counter() - t0
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if payload is None:
        status = "oom" if proc.exitcode == -9 else "error"
        payload = f"child died (exit code {proc.exitcode}{', killed: out of memory?' if status == 'oom' else ''})"
    recv.close()
    return status, payload, wall


# ----------------------------------------------------------------------------------------------- driver


def predict_skip(history: list[dict], n: int, batch: int, max_seconds: float, max_gib: float) -> str | None:
    """Why (model, n) will not fit, from the model's earlier runs at shorter prompts (same batch), or None.

    Time: prefill grows as n^p with p fitted to the last two runs (clamped to [1, 2]; 1 after a single run),
    decode as n. Memory above the model's own grows linearly in n."""
    done = [r for r in history if r["batch"] == batch and "ttft_s" in r and r["context"] < n]
    if not done:
        return None
    last = done[-1]
    grow = n / last["context"]
    p = 1.0
    if len(done) >= 2:
        prev = done[-2]
        if last["ttft_s"] > 0 and prev["ttft_s"] > 0:
            p = math.log(last["ttft_s"] / prev["ttft_s"]) / math.log(last["context"] / prev["context"])
            p = min(2.0, max(1.0, p))
    est_s = last["ttft_s"] * grow**p + (last["total_s"] - last["ttft_s"]) * grow
    if est_s > max_seconds:
        return f"estimated {est_s:.0f} s (from {last['context']} tokens) > --max-seconds {max_seconds:g}"
    est_gib = (last["model_rss_mib"] + (last["peak_rss_mib"] - last["model_rss_mib"]) * grow) / 1024
    if est_gib > max_gib:
        return f"estimated peak {est_gib:.1f} GiB (from {last['context']} tokens) > --max-gib {max_gib:g}"
    return None


def run(args) -> dict:
    s = dict(width=args.width, layers=args.layers, heads=args.heads, vocab=args.vocab, threads=args.threads,
             mamba_state=args.mamba_state, prefill_chunk=args.prefill_chunk, seed=args.seed)
    jobs = [(n, 1) for n in args.contexts]
    jobs += [(args.batch_context, b) for b in args.batches if not (b == 1 and args.batch_context in args.contexts)]
    jobs.sort()
    history: dict[str, list[dict]] = {m: [] for m in args.models}
    stopped: dict[tuple[str, int], str] = {}  # (model, batch) -> why longer prompts are not run
    rows = []
    for n, batch in jobs:
        for name in args.models:  # round-robin over the models at each (context, batch)
            base = dict(model=name, context=n, batch=batch, new_tokens=args.new_tokens)
            # what the cache holds after generate(): the prompt and every new token but the last, which is not fed
            computed = kv_cache_bytes(name, s, n + args.new_tokens - 1, batch)
            if computed is not None:
                base["cache_bytes_computed"] = computed
            why = stopped.get((name, batch)) or predict_skip(history[name], n, batch, args.max_seconds, args.max_gib)
            if why:
                rows.append({**base, "skipped": why})
                print(f"n {n:6d} batch {batch:2d}  {name:20s} skipped: {why}", flush=True)
                continue
            job = dict(settings=s, model=name, context=n, batch=batch, new_tokens=args.new_tokens,
                       max_bytes=args.max_gib * 2**30)
            status, payload, wall = run_child(job, args.max_seconds)
            if status == "ok":
                row = {**payload, **{k: v for k, v in base.items() if k not in payload}}
                history[name].append(row)
                print(f"n {n:6d} batch {batch:2d}  {name:20s} ttft {row['ttft_s']:8.3f} s  "
                      f"decode {row['decode_ms_per_token']:8.2f} ms/tok  peak {row['peak_rss_mib']:8.0f} MiB  "
                      f"cache {row['cache_bytes'] / MIB:9.3f} MiB  ({wall:.1f} s)", flush=True)
            elif status in ("timeout", "oom"):
                why = payload if status == "timeout" else f"out of memory (--max-gib {args.max_gib:g}): {payload}"
                row = {**base, "skipped": why}
                stopped[(name, batch)] = f"{'timeout' if status == 'timeout' else 'out of memory'} at {n} tokens"
                print(f"n {n:6d} batch {batch:2d}  {name:20s} skipped: {why}", flush=True)
            else:
                row = {**base, "error": payload}
                stopped[(name, batch)] = f"error at {n} tokens"
                print(f"n {n:6d} batch {batch:2d}  {name:20s} ERROR\n{payload}", flush=True)
            row["load_avg_1min"] = os.getloadavg()[0]  # other processes' load on the machine, after the run
            rows.append(row)
    add_ratios(rows)
    settings = dict(**{k: v for k, v in s.items() if k != "seed"}, seed=args.seed, dtype="float32",
                    head_dim=args.width // args.heads, new_tokens=args.new_tokens, contexts=args.contexts,
                    batches=args.batches, batch_context=args.batch_context, models=args.models,
                    max_seconds=args.max_seconds, max_gib=args.max_gib, quick=args.quick, million=args.million,
                    mamba2=mamba2_config(s).to_diff_dict() if MAMBA2 in args.models else None,
                    method=dict(ttft="generate() call to the first step's logits (set-up + prefill, logits_to_keep=1)",
                                decode="(last step - first step) / (new_tokens - 1), one greedy generate()",
                                memory="child process VmHWM (forked after imports); model_rss after build+warm-up",
                                cache="bytes of the cache generate() returns",
                                compiled="static cache of n + new tokens; generate() compiles the decode step "
                                         "(fullgraph, inductor) during the warm-up (warmup_s), not timed",
                                chunked="generate(prefill_chunk_size=prefill_chunk)",
                                cache_computed="models whose cache keeps every position: bytes after n + new - 1 "
                                               "tokens from the config (float32 rows, int64 positions), not "
                                               "measured"),
                    torch=torch.__version__, transformers=transformers.__version__,
                    python=platform.python_version(), machine=platform.machine(),
                    processor=platform.processor() or "unknown", cpus=os.cpu_count())
    return {"rows": rows, "growth": growth(rows), "settings": settings}


def growth(rows: list[dict]) -> list[dict]:
    """Per model (batch 1), between consecutive measured prompt lengths n0 < n1: the exponent p with
    figure(n1) / figure(n0) = (n1 / n0)^p of time to first token, decode ms/token and the peak above the model
    (1 is linear in n, 2 quadratic, 0 flat)."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        done = sorted((r for r in rows if r["model"] == name and r["batch"] == 1 and "ttft_s" in r),
                      key=lambda r: r["context"])
        for a, b in zip(done, done[1:]):
            out.append(dict(model=name, context_from=a["context"], context_to=b["context"],
                            ttft_exponent=_exponent(a, b, a["ttft_s"], b["ttft_s"]),
                            decode_exponent=_exponent(a, b, a["decode_ms_per_token"], b["decode_ms_per_token"]),
                            peak_above_model_exponent=_exponent(a, b, _added_mib(a), _added_mib(b))))
    return out


def _exponent(a: dict, b: dict, fa: float, fb: float) -> float | None:
    """p with fb / fa = (n_b / n_a)^p; None where a figure is not positive."""
    return math.log(fb / fa) / math.log(b["context"] / a["context"]) if fa > 0 and fb > 0 else None


def add_ratios(rows: list[dict]) -> None:
    """``ttft_vs_gpt2``, ``decode_vs_gpt2``, ``cache_vs_gpt2`` and ``added_vs_gpt2`` (peak RSS above the model's own
    resident memory): a row's figure over GPT-2's at the same n and batch."""
    ref = {(r["context"], r["batch"]): r for r in rows if r["model"] == GPT2 and "ttft_s" in r}
    for r in rows:
        g = ref.get((r["context"], r["batch"]))
        if g is None or "ttft_s" not in r:
            continue
        r["ttft_vs_gpt2"] = r["ttft_s"] / g["ttft_s"]
        r["decode_vs_gpt2"] = r["decode_ms_per_token"] / g["decode_ms_per_token"]
        r["cache_vs_gpt2"] = r["cache_bytes"] / g["cache_bytes"]
        r["added_vs_gpt2"] = _added_mib(r) / max(_added_mib(g), 1e-9)


def _added_mib(r: dict) -> float:
    """Peak resident memory above the model's own (prompt, activations, cache): what the mixer decides, apart from the
    process (PyTorch, transformers, weights) that every model pays."""
    return r["peak_rss_mib"] - r["model_rss_mib"]


def _ratio(r: dict, key: str) -> str:
    return f" ({r[key]:.2f}x)" if key in r else ""


def table(result: dict) -> str:
    rows, s = result["rows"], result["settings"]
    out = [f"prompts of n tokens, batch 1, {s['new_tokens']} new tokens, {s['threads']} thread(s); "
           "(x) = ratio to gpt2 at the same n",
           "| n | model | time to first token s (x) | decode ms/token (x) | decode tok/s | peak RSS MiB | "
           "peak above the model MiB (x) | cache MiB (x) |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    single = [r for r in rows if r["batch"] == 1]
    for r in sorted(single, key=lambda r: r["context"]):
        out.append(_line(r, [f"{r.get('ttft_s', 0):.3f}{_ratio(r, 'ttft_vs_gpt2')}",
                             f"{r.get('decode_ms_per_token', 0):.2f}{_ratio(r, 'decode_vs_gpt2')}",
                             f"{r.get('decode_tokens_per_s', 0):.1f}", f"{r.get('peak_rss_mib', 0):.0f}",
                             f"{_added_mib(r) if 'ttft_s' in r else 0:.0f}{_ratio(r, 'added_vs_gpt2')}",
                             f"{r.get('cache_bytes', 0) / MIB:.3f}{_ratio(r, 'cache_vs_gpt2')}"]))
    batched = sorted((r for r in rows if r["context"] == s["batch_context"] and r["batch"] in s["batches"]),
                     key=lambda r: (r["batch"], 0))
    if batched:
        out += ["", f"batched decode at n = {s['batch_context']}: tokens/s over all sequences",
                "| batch | model | decode tok/s | ms/step (x) | time to first token s | peak RSS MiB |",
                "|---:|---|---:|---:|---:|---:|"]
        for r in batched:
            cells = [f"{r.get('decode_tokens_per_s', 0):.1f}",
                     f"{r.get('decode_ms_per_token', 0):.2f}{_ratio(r, 'decode_vs_gpt2')}",
                     f"{r.get('ttft_s', 0):.3f}", f"{r.get('peak_rss_mib', 0):.0f}"]
            out.append(_line(r, cells, first=str(r["batch"])))
    if result.get("growth"):
        out += ["", "growth between measured prompt lengths: figure ~ n^p (1 linear, 2 quadratic, 0 flat)",
                "| model | n from | n to | p of time to first token | p of decode ms/token | p of peak above the model |",
                "|---|---:|---:|---:|---:|---:|"]
        for g in result["growth"]:
            cells = [f"{g[k]:.2f}" if g[k] is not None else "n/a"
                     for k in ("ttft_exponent", "decode_exponent", "peak_above_model_exponent")]
            out.append(f"| {g['model']} | {g['context_from']} | {g['context_to']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _line(r: dict, cells: list[str], first: str | None = None) -> str:
    lead = first if first is not None else str(r["context"])
    if "ttft_s" not in r:
        cells = [f"skipped: {r['skipped']}" if "skipped" in r else "error (see the JSON)"] + [""] * (len(cells) - 1)
        if "cache_bytes_computed" in r:
            cells[-1] = f"{r['cache_bytes_computed'] / MIB:.3f} (computed)"
    return f"| {lead} | {r['model']} | " + " | ".join(cells) + " |"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["batch"] == 1 and "ttft_s" in r]
    names = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["context"])
        if not mine:
            continue
        ctx = [r["context"] for r in mine]
        style = dict(marker="o", linewidth=2.5 if name in (GPT2, MAMBA2) else 1.5,
                     color={GPT2: "black", MAMBA2: "grey"}.get(name),
                     linestyle="--" if name == MAMBA2 else ":" if name.endswith(COMPILED) else "-")
        ax1.plot(ctx, [r["decode_ms_per_token"] for r in mine], label=name, **style)
        ax2.plot(ctx, [r["ttft_s"] for r in mine], label=name, **style)
    s = result["settings"]
    for ax, ylabel in ((ax1, "decode ms per token"), (ax2, "time to first token (s)")):
        log_axes(ax, "prompt length (tokens)", ylabel)
    if rows:
        ax1.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"generate(), batch 1, {s['new_tokens']} new tokens, width {s['width']}, {s['layers']} layers, "
                 f"{s['heads']} heads, vocab {s['vocab']}, {s['threads']} thread(s), float32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    png = write_result(args.out, result, plot)
    print(table(result))
    print(f"wrote {args.out} and {png}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
