"""Loads the suite's JSONL files for lm-eval (`custom_dataset: !function data.load`).

A plain `dataset_path: json` would resolve `data_files` against the current directory; this loader
resolves them next to itself, so the tasks work from anywhere and never touch the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def load(file: str, **metadata: object) -> datasets.DatasetDict:
    """The `test` split from `file` (one JSON object a line). lm-eval also passes the task's metadata
    as keyword arguments; it does not change the data."""
    rows = [json.loads(line) for line in (HERE / file).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
