"""The model card a trained model folder carries as its ``README.md``, filled from the run's results.

The template, ``model_card.md`` beside this module, is package data so that an installed package renders it;
``model_cards/README.md`` at the repository root says how cards are made."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent / "model_card.md"


def _yaml_list(items: list[str]) -> str:
    return "".join(f"\n- {json.dumps(str(i))}" for i in items) if items else " []"


def render_model_card(info: dict, template: str | os.PathLike = MODEL_CARD_TEMPLATE) -> str:
    """Fill ``model_card.md`` beside this module (``{{key}}`` placeholders) from a run's ``info``.

    Expected keys: ``model_name``, ``mixer``, ``model_type``, ``params``, ``config_name``, ``data``,
    ``datasets`` (Hub dataset ids, may be empty), ``tokenizer``, ``steps``, ``tokens``, ``seq_len``,
    ``batch_size``, ``lr``, ``val_loss``, ``val_ppl``, ``dataset_name``, ``train_command``, ``repo_id``,
    ``base_tags``. Missing values render as ``n/a``.
    """
    text = Path(template).read_text()
    values = dict(info)
    values.setdefault("datasets_yaml", _yaml_list(values.get("datasets") or []))
    values.setdefault("tags_yaml", _yaml_list(values.get("tags") or []))
    for key in ("val_loss", "val_ppl"):
        if isinstance(values.get(key), float):
            values[key] = f"{values[key]:.4f}"

    def sub(m: re.Match) -> str:
        v = values.get(m.group(1))
        return "n/a" if v is None else str(v)

    out = re.sub(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}", sub, text)
    if "model-index" in out and values.get("val_ppl") is None:
        # no eval result: drop the model-index block rather than publish n/a metrics
        out = re.sub(r"model-index:\n(?:[ -].*\n)+", "", out)
    return out
