"""The pretraining loop (``scripts/pretrain.py`` is its command line, and its help describes the run): Accelerate
set up once (one process, DDP or FSDP2), then one loop from the first step (or the resumed one) to the last, read top
to bottom in :func:`_run`: the learning rate, the micro-batches of the step, the clipped update, the metrics row,
the validation loss, the checkpoint. What it needs lives in this package: the data (:mod:`.data`), the model
(:mod:`.models`), checkpoints and resuming (:mod:`.checkpoints`), the validation loss (:mod:`.evaluate`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from .. import files, locks
from . import data as hdata
from .card import render_model_card
from .checkpoints import (
    absolute_data_dir,
    check_layout,
    check_resumable,
    choose_checkpoint,
    clean_temporary_checkpoints,
    latest_checkpoint,
    publish_model_folder,
    run_record,
    save_checkpoint,
)
from .config import ConfigError, RunError, batch_layout, default_data_dir, load_config
from .evaluate import EVAL_KEYS, describe_eval, evaluate_loss
from .fsdp import FSDP_SETTINGS, enable_fsdp_on_cpu, fit_wrap_classes, fsdp_plugin
from .launch import describe_distributed
from .memory import keep_freed_memory, memory_use
from .metrics import plot_loss, truncate_metrics
from .models import build_model, complexity_of, count_parameters, lm_loss, mixer_slug, model_label
from .optim import FUSED_ADAMW_DEVICES, build_optimizer, lr_at


def _resolve_config(args) -> dict:
    overrides = list(args.overrides)
    if args.mixer:
        overrides.append(f"model.mixer={args.mixer}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.save_every is not None:
        overrides.append(f"checkpoint.every={args.save_every}")
    if args.eval_every is not None:
        overrides.append(f"eval.every={args.eval_every}")
    if args.data:
        overrides.append(f"data.dir={args.data}")
    return load_config(args.config, overrides)  # which also checks every numeric setting


def _mixed_precision(setting: str) -> str:
    """``auto``: bf16 on GPUs that support it, else fp16 on GPUs, no mixed precision on CPU. An explicit
    ``accelerate launch --mixed_precision fp16|bf16`` wins over ``auto`` (the launcher's default "no" does not:
    use ``--set train.mixed_precision=no`` for float32 on a GPU)."""
    if setting != "auto":
        return setting
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched not in ("", "no"):
        return launched
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() not in ("true", "1"):
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def _trackers(setting) -> list[str] | None:
    if setting in (None, "none", False):
        return None
    if setting == "auto":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                return None
        return ["tensorboard"]
    return [setting] if isinstance(setting, str) else list(setting)


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _finite(value: float, what: str, step: int, output_dir: Path) -> None:
    if not math.isfinite(value):
        last = latest_checkpoint(output_dir)
        raise RunError(f"{what} at step {step} is {value}: the run diverged or its weights hold NaN/Inf. The last "
                         f"checkpoint written before it is {last if last else '(none)'}; start again into a new "
                         f"--output-dir with a lower --set train.lr=... or more --set train.warmup_steps=...")


def _scalar(x) -> float:
    """A float from a number, a tensor, or a (replicated) DTensor such as FSDP's gradient norm."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def _model_class(model) -> type:
    """The model's own class: FSDP2 swaps a sharded module's class for a subclass named ``FSDP<class>``."""
    from transformers import PreTrainedModel

    return next((c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP")),
                type(model))


def params_checksum(model) -> torch.Tensor:
    """A float64 fingerprint of all parameters, shape (1,) (equal weights give equal numbers)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        total += (p.detach().double().cpu() * (1.0 + 1e-3 * (i % 7))).sum()
    return total.reshape(1)


def ensure_data(accelerator, cfg: dict) -> Path:
    """The prepared data folder, as an absolute path; prepares the offline default on the main process when none
    is configured."""
    data_dir = cfg["data"]["dir"]
    if data_dir is None:
        data_dir = default_data_dir()
        if accelerator.is_main_process and not hdata.is_prepared(data_dir):
            print(f"[pretrain] no --data given: preparing the offline default corpus in {data_dir}", flush=True)
            with files.writing(data_dir, "or pass --data with a folder prepared elsewhere"):
                hdata.prepare_dataset(data_dir, source=hdata.STDLIB)
        accelerator.wait_for_everyone()
    data_dir = Path(data_dir)
    hdata.verify_prepared(data_dir)  # says what is missing, unfinished or damaged, and the fix
    return data_dir.resolve()


def _memory(accelerator, *splits: hdata.TokenShards) -> dict:
    """Peak RSS of every process, how much of the token shards each holds in memory, and on a GPU the peak memory
    torch's allocator held there, in MiB (Linux)."""
    files = [Path(a.filename) for ts in splits for a in ts.arrays]
    use = memory_use(files)
    gpu = torch.cuda.max_memory_allocated(accelerator.device) if accelerator.device.type == "cuda" else -1.0
    row = torch.tensor([use["peak_rss_bytes"], use["shards_resident_bytes"], gpu] if use else [-1.0, -1.0, gpu],
                       dtype=torch.float64, device=accelerator.device)
    rows = accelerator.gather(row[None]).reshape(-1, 3).cpu()
    if use is None or (rows[:, :2] < 0).any():
        return {}
    mib = lambda b: round(float(b) / 2**20, 1)
    out = {"peak_rss_mib": [mib(b) for b in rows[:, 0]], "shards_resident_mib": [mib(b) for b in rows[:, 1]],
           "shards_mib": mib(use["shards_bytes"])}
    if (rows[:, 2] >= 0).all():
        out["peak_gpu_mib"] = [mib(b) for b in rows[:, 2]]
    return out


def write_final(accelerator, model, tokenizer, cfg: dict, output_dir: Path, data_meta: dict, results: dict,
                argv: list[str]) -> None:
    """The save_pretrained folder, tokenizer, loss plot, results and card. Call on EVERY process (the full state
    dict is gathered collectively under FSDP); only the main process writes."""
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    raw = accelerator.unwrap_model(model)
    cls = _model_class(raw)
    if type(raw) is not cls:
        # a sharded model's class is FSDP's subclass: save_pretrained would ship torch's module as the model's code.
        # An empty (meta) instance of the model's own class writes the gathered weights instead.
        with torch.device("meta"):
            raw = cls(raw.config)
        # tied parameters (the output embedding) come gathered as separate copies: keep one name, as unsharded saves do
        first: dict[int, str] = {}
        for name, p in raw.named_parameters(remove_duplicate=False):
            if first.setdefault(id(p), name) != name:
                state_dict.pop(name, None)
    staged = output_dir / ".tmp_final"
    try:
        with files.writing(output_dir, "then run the same command with --resume: it writes the model folder from "
                                       "the last checkpoint"):
            shutil.rmtree(staged, ignore_errors=True)
            raw.save_pretrained(staged, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(staged)
            plot_loss(output_dir / "metrics.jsonl", staged / "loss.png",
                        title=f"{model_label(cfg['model'])} ({cfg['name']})")
            files.atomic_write_json(staged / "train_results.json", results)
            (staged / "README.md").write_text(render_model_card(card_info(cfg, data_meta, results, argv, raw)))
            publish_model_folder(staged, output_dir)
    except Exception:
        shutil.rmtree(staged, ignore_errors=True)  # never loaded (no config.json moved out of it): only space
        raise


def card_info(cfg: dict, data_meta: dict, results: dict, argv: list[str], model) -> dict:
    mixer = model_label(cfg["model"])
    cx = complexity_of(mixer)
    complexity = f"{cx['time_per_token']} / {cx['cache']}" if cx else "n/a"
    source = data_meta.get("source")
    hub_dataset = source if source not in (hdata.STDLIB, "files", None) else None
    c = model.config
    shape = ", ".join(f"{k} {getattr(c, k)}" for k in ("n_layer", "n_embd", "n_head", "n_inner", "vocab_size")
                      if getattr(c, k, None) is not None)
    return {
        "model_name": Path(results.get("output_dir", "model")).name,
        "mixer": mixer,
        "complexity": complexity,
        "model_type": _model_class(model).__name__,
        "shape": shape,
        "params": f"{results['params']:,}",
        "config_name": cfg["name"],
        "data": data_meta.get("data"),
        "datasets": [hub_dataset] if hub_dataset else [],
        "dataset_id": hub_dataset or ("python-stdlib-text" if source == hdata.STDLIB else "local-files"),
        "dataset_name": hub_dataset or data_meta.get("data", "n/a").split(":")[0],
        "tokenizer": data_meta.get("tokenizer_description"),
        "steps": results["steps"],
        "tokens": f"{results['tokens']:,}",
        "seq_len": cfg["data"]["seq_len"],
        "batch_size": cfg["train"]["batch_size"],
        "lr": cfg["train"]["lr"],
        "val_loss": results.get("val_loss"),
        "val_ppl": results.get("val_ppl"),
        "val_measure": (f"{results['val_windows']} non-overlapping windows of {results['val_window']} tokens"
                        if "val_windows" in results else "n/a"),
        "train_command": "python scripts/pretrain.py " + " ".join(shlex.quote(a) for a in argv),
        "repo_id": "REPO_ID",
        "tags": ["hf-resolvent", "resolvent", "token-mixer", f"mixer-{mixer_slug(mixer)}", "causal-lm"],
        "limitations": ("A small research model trained for a short time; it is not instruction-tuned and "
                        "produces unreliable text. "
                        + ("It was trained on the offline default corpus (Python standard-library text), "
                           "so it writes Python documentation-like text only."
                           if source == hdata.STDLIB else "")),
    }


def train(args, argv: list[str]) -> dict:
    """Run (or resume) a pretraining run; returns the final results dict (on every process). ``args`` holds the
    attributes of scripts/pretrain.py's options; ``argv`` is recorded as the command (model card, run record)."""
    cfg = _resolve_config(args)
    output_dir = Path(args.output_dir)

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    trackers = _trackers(cfg["log"]["trackers"])
    launched_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")
    plugin = None
    if args.fsdp or launched_fsdp:
        plugin = fsdp_plugin(None if launched_fsdp else FSDP_SETTINGS)  # the launcher's settings win
        _one_process_group()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(
        mixed_precision=_mixed_precision(cfg["train"]["mixed_precision"]),
        log_with=trackers,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        fsdp_plugin=plugin,
        # without a GPU, Accelerate runs processes started by torchrun as unrelated single runs unless told "cpu"
        cpu=not torch.cuda.is_available() and (plugin is not None or launched > 1),
    )
    if "WORLD_SIZE" in os.environ and launched != accelerator.num_processes:
        raise ConfigError(f"the launcher started {launched} processes but Accelerate set up "
                            f"{describe_distributed(accelerator)}; launch with accelerate launch or torchrun on "
                            f"GPUs, or with ACCELERATE_USE_CPU=true on CPU processes")
    if plugin is not None:
        enable_fsdp_on_cpu(accelerator, plugin)
        _require_fsdp(accelerator, "--fsdp" if args.fsdp else "the accelerate config")
    if accelerator.is_main_process:  # the run's first line: how it is distributed
        print(f"[pretrain] {describe_distributed(accelerator)}", flush=True)
    # one run per output folder: the main process holds the lock until the run ends, however it ends
    with contextlib.ExitStack() as run_lock:
        if accelerator.is_main_process:
            with files.writing(output_dir, "or pass another --output-dir"):  # the run's first write
                run_lock.enter_context(locks.exclusive(output_dir / ".run.lock", what=f"the run folder {output_dir}",
                                                       fix="wait for that run to end, or pass another --output-dir"))
        return _run(args, argv, cfg, accelerator, output_dir, trackers)


def _require_fsdp(accelerator, asked_by: str) -> None:
    """FSDP asked for and something else set up (DDP, one process) is an error, never a silent fallback."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        raise ConfigError(f"FSDP was asked for ({asked_by}) but Accelerate set up "
                            f"{describe_distributed(accelerator)}: it shards on CUDA GPUs and, through this script, "
                            f"on CPU processes. Launch on one of those, or drop {asked_by}")


def _one_process_group() -> None:
    """FSDP needs a process group, even of one process: ``python scripts/pretrain.py --fsdp`` (no launcher) gets one
    of size 1 on this machine, so that a sharded checkpoint can be resumed, or a sharded run tried, without one."""
    if any(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))


def _run(args, argv: list[str], cfg: dict, accelerator, output_dir: Path, trackers) -> dict:
    from accelerate.utils import DistributedType, set_seed

    main = accelerator.is_main_process
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    how = describe_distributed(accelerator)
    log = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
    warn = (lambda m: print(f"[pretrain] {m}", file=sys.stderr, flush=True)) if main else (lambda m: None)
    if accelerator.device.type == "cpu":
        keep_freed_memory()  # reuse the large blocks every step frees (see its docstring)
    data_dir = ensure_data(accelerator, cfg)
    # recorded as an absolute path: evaluate.py (and a resume) find the data from any working folder
    cfg = {**cfg, "data": {**cfg["data"], "dir": str(data_dir)}}
    data_meta = json.loads((data_dir / "meta.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data_dir / data_meta.get("tokenizer_dir", "tokenizer"))
    train_tokens = hdata.TokenShards(data_dir, "train")
    val_tokens = hdata.TokenShards(data_dir, "val")
    seq_len = int(cfg["data"]["seq_len"])
    hdata.eval_windows(val_tokens, seq_len, 1)  # a validation split too short for one window fails now, not later
    micro, accum = batch_layout(cfg, accelerator.num_processes)
    tcfg = cfg["train"]
    max_steps = int(tcfg["max_steps"])
    sampler = hdata.StepSampler(train_tokens, seq_len, micro, accum, accelerator.num_processes, int(tcfg["seed"]))

    # ---- resume bookkeeping: the checkpoint itself records what it was trained with
    record = run_record(cfg, data_meta, train_tokens, val_tokens)
    saved_cfg_path = output_dir / "run_config.json"
    last = latest_checkpoint(output_dir)
    if last is not None and not args.resume:
        raise ConfigError(f"{output_dir} already holds checkpoints ({last.name}); pass --resume to continue "
                            f"that run, or choose another --output-dir")
    if args.resume and last is not None:
        last = choose_checkpoint(accelerator, output_dir, warn)
        check_layout(last, fsdp, how)
        saved = json.loads((last / "trainer_state.json").read_text()).get("run")
        if saved is None:
            raise ConfigError(f"{last} does not record the configuration it was trained with (an older "
                                f"version wrote it), so it cannot be checked against this run; train into another "
                                f"--output-dir")
        check_resumable(absolute_data_dir(saved), record)
    accelerator.wait_for_everyone()
    if main:
        with files.writing(output_dir, "or pass another --output-dir"):
            output_dir.mkdir(parents=True, exist_ok=True)
            clean_temporary_checkpoints(output_dir)
            files.atomic_write_json(saved_cfg_path, cfg)

    set_seed(int(tcfg["seed"]))
    model = build_model(cfg["model"], len(tokenizer), seq_len, eos_token_id=tokenizer.eos_token_id)
    if tcfg.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    params = count_parameters(model)
    optimizer = build_optimizer(model, tcfg["lr"], tcfg["betas"], tcfg["weight_decay"], tcfg["eps"],
                                  fused=accelerator.device.type in FUSED_ADAMW_DEVICES)  # prepare() moves it
    if fsdp:
        fit_wrap_classes(accelerator.state.fsdp_plugin, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    if fsdp:
        from torch.distributed.tensor import DTensor

        unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if unsharded:
            raise RunError(f"FSDP was set up but prepare() left {len(unsharded)} parameter(s) unsharded "
                             f"({', '.join(unsharded[:3])}, ...): check the FSDP settings (fsdp_version: 2)")
    if tcfg.get("compile"):
        model = torch.compile(model)
    if accelerator.device.type == "cpu" and cfg["model"]["type"] == "resolvent":
        from hf_resolvent.backends import cpu as cpu_kernels

        with accelerator.main_process_first():  # compile (first use only) before the progress bar, once
            cpu_kernels.available()

    step, tokens_seen, train_time = 0, 0, 0.0
    if args.resume and last is not None:
        accelerator.load_state(str(last))
        state = json.loads((last / "trainer_state.json").read_text())
        step, tokens_seen, train_time = state["step"], state["tokens"], state.get("train_time", 0.0)
        log(f"[pretrain] resumed from {last} (step {step}/{max_steps})")
    elif args.resume:
        log(f"[pretrain] --resume: no checkpoint in {output_dir}, starting from step 0")
    if main:
        with files.writing(output_dir):
            truncate_metrics(output_dir / "metrics.jsonl", step)

    tokens_per_step = sampler.global_batch * seq_len
    label = model_label(cfg["model"])
    log(f"[pretrain] model {_model_class(accelerator.unwrap_model(model)).__name__} mixer={label}: {params:,} "
        f"parameters")
    log(f"[pretrain] data {data_dir}: {data_meta['data']}")
    log(f"[pretrain] tokenizer: {data_meta['tokenizer_description']}")
    log(f"[pretrain] {len(train_tokens):,} train / {len(val_tokens):,} val tokens; batch {sampler.global_batch} x "
        f"{seq_len} = {tokens_per_step:,} tokens/step ({accelerator.num_processes} process(es) x micro-batch "
        f"{micro} x accumulation {accum}); device {accelerator.device}, mixed precision "
        f"{accelerator.mixed_precision}")
    if trackers:
        accelerator.init_trackers(mixer_slug(cfg["name"]), config=_flat(cfg))

    metrics_path = output_dir / "metrics.jsonl"

    def log_row(row: dict) -> None:
        if main:
            with files.writing(output_dir, "then run the same command with --resume"), open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if trackers:
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    from tqdm.auto import tqdm

    bar = tqdm(total=max_steps, initial=step, disable=not main or args.quiet, unit="step", dynamic_ncols=True)
    ev = cfg["eval"]
    last_eval: dict = {}
    model.train()
    window_loss, window_steps, window_t0 = torch.zeros((), device=accelerator.device), 0, time.time()
    while step < max_steps:
        lr = lr_at(step, tcfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t_step = time.time()
        for m in range(accum):
            batch = torch.from_numpy(sampler.batch(step, m, accelerator.process_index)).to(accelerator.device)
            sync = contextlib.nullcontext() if m == accum - 1 else accelerator.no_sync(model)
            with sync:
                with accelerator.autocast():
                    loss = lm_loss(model, batch)
                accelerator.backward(loss / accum)
            window_loss += loss.detach() / accum
        grad_norm = _scalar(accelerator.clip_grad_norm_(model.parameters(), float(tcfg["grad_clip"])))
        # the norm of the all-reduced gradient: every process sees the same value, so all stop together
        _finite(grad_norm, "the gradient norm of the training loss", step + 1, output_dir)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        train_time += time.time() - t_step
        window_steps += 1
        if step % int(cfg["log"]["every"]) == 0 or step == max_steps:
            mean_loss = accelerator.reduce(window_loss, reduction="mean").item() / window_steps
            elapsed = time.time() - window_t0
            tps = window_steps * tokens_per_step / max(elapsed, 1e-9)
            # loss_steps: the steps the loss averages, ending at this one (fewer than log.every after a resume: the
            # steps before it are in the row the checkpoint kept, or were trained again)
            row = {"step": step, "loss": mean_loss, "loss_steps": window_steps, "lr": lr, "grad_norm": grad_norm,
                   "tokens": tokens_seen, "tokens_per_s": tps}
            log_row(row)
            bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            window_loss.zero_()
            window_steps, window_t0 = 0, time.time()
        if step % int(ev["every"]) == 0 or step == max_steps:
            last_eval = evaluate_loss(accelerator, model, val_tokens, seq_len, int(ev["max_windows"]),
                                      int(ev["micro_batch"]))
            _finite(last_eval["val_loss"], "the validation loss", step, output_dir)
            log_row({"step": step, **last_eval})
            if main:
                bar.write(f"[pretrain] step {step}: {describe_eval(last_eval)}")
            window_t0 = time.time()
        if step % int(cfg["checkpoint"]["every"]) == 0 or step == max_steps:
            state = {"step": step, "tokens": tokens_seen, "train_time": train_time, **last_eval, "run": record,
                     "distributed": how}
            save_checkpoint(accelerator, model, output_dir, step, state, int(cfg["checkpoint"]["keep"]))
            window_t0 = time.time()
        bar.update(1)
        if args.pause_after is not None and step == args.pause_after:
            log(f"[pretrain] --pause-after {step}: waiting to be killed")
            time.sleep(600)
        if args.stop_after is not None and step >= args.stop_after and step < max_steps:
            bar.close()
            log(f"[pretrain] --stop-after {args.stop_after}: stopping as if killed (no final save)")
            return {"stopped_at": step}
    bar.close()

    if not last_eval:  # resumed from the final checkpoint: the eval result is stored there
        state = json.loads((last / "trainer_state.json").read_text()) if last else {}
        last_eval = {k: state[k] for k in EVAL_KEYS if k in state}
        if len(last_eval) < len(EVAL_KEYS):
            last_eval = evaluate_loss(accelerator, model, val_tokens, seq_len, int(ev["max_windows"]),
                                      int(ev["micro_batch"]))
        _finite(last_eval["val_loss"], "the validation loss", step, output_dir)
    replicated = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                  DistributedType.MULTI_CPU)
    checksums = (accelerator.gather(params_checksum(accelerator.unwrap_model(model)).to(accelerator.device))
                 if replicated else torch.zeros(0))  # sharded parameters (FSDP, DeepSpeed): nothing to compare
    results = {"output_dir": str(output_dir), "config": cfg["name"], "model": label, "params": params,
               "steps": step, "tokens": tokens_seen, "train_time_s": round(train_time, 2),
               "processes": accelerator.num_processes, "data": data_meta["data"],
               "tokenizer": data_meta["tokenizer_description"], "distributed": how,
               "process_checksums": [float(c) for c in checksums.reshape(-1).tolist()],
               **_memory(accelerator, train_tokens, val_tokens), **last_eval}
    if len(set(results["process_checksums"])) > 1:
        raise RuntimeError(f"the processes ended with different weights: {results['process_checksums']}")
    accelerator.wait_for_everyone()
    if not args.no_final_save:
        write_final(accelerator, model, tokenizer, cfg, output_dir, data_meta, results, argv)
    if "peak_rss_mib" in results:
        log(f"[pretrain] memory per process (rank 0, 1, ...): peak RSS {results['peak_rss_mib']} MiB; token shards "
            f"resident {results['shards_resident_mib']} MiB of {results['shards_mib']} MiB (memory-mapped, each rank "
            f"reads its own windows)" + (f"; peak GPU memory {results['peak_gpu_mib']} MiB (torch's allocator)"
                                         if "peak_gpu_mib" in results else ""))
    if main and not args.no_final_save:
        log(f"[pretrain] done: {step} steps, {tokens_seen:,} tokens in {train_time:.0f}s; {describe_eval(results)}")
        log(f"[pretrain] wrote the model folder {output_dir} (save_pretrained + tokenizer + README.md), "
            f"{output_dir / 'loss.png'} and {metrics_path}")
    accelerator.wait_for_everyone()
    if trackers:
        accelerator.end_training()
    return results
