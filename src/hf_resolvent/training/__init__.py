"""What the training, evaluation and sharing scripts of ``scripts/`` run, a module per job.

- :mod:`.loop`: the pretraining loop (Accelerate, one process, DDP or FSDP2; resumable at every step);
- :mod:`.config`: run configs (the YAML files of ``configs/``, package data), read and checked;
- :mod:`.models`: the models of the papers' comparison (resolvent mixers and the GPT-2 baseline) and their labels;
- :mod:`.optim`: AdamW and the learning-rate schedule;
- :mod:`.checkpoints`: checkpoints with checksum manifests, resuming from the newest intact one, the final folder;
- :mod:`.metrics`: metrics JSONL, the loss plot, the results of the comparison scripts;
- :mod:`.card`: the model card (its template ``model_card.md`` is package data);
- :mod:`.launch`: multi-process CPU runs under ``accelerate launch``, the distribution in words;
- :mod:`.fsdp`: FSDP2 through Accelerate, on GPUs and CPU processes;
- :mod:`.memory`: the allocator setting and the memory report of a training process;
- :mod:`.data`: corpora, tokenizers, prepared token shards and the step-indexed sampler;
- :mod:`.evaluate`: strided perplexity, sample generations, the comparison table and figure.

Each script of ``scripts/`` is its argument parser and a call into these; the studies of ``experiments/`` (outside
the package) train with them too. What a user of the model imports lives one level up (config, model, cache, ops,
patterns).
"""
