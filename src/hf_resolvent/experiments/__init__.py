"""The papers' experiments as a library the runners in ``scripts/`` share.

- :mod:`.training`: run configs (the YAML files of ``configs/``, package data), the model factory for the
  comparison (resolvent mixers and the GPT-2 baseline), the learning-rate schedule, the optimizer, checkpoint
  manifests, metrics and the model card (``model_card.md``);
- :mod:`.synthetic`: the synthetic tasks (copy, associative recall, multi-hop recall) as batch generators.

What a user of the model imports lives one level up (config, model, cache, ops, patterns, data).
"""
