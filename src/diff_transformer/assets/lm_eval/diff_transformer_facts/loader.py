"""Loads facts.jsonl from this folder, wherever lm_eval runs from (a relative ``data_files``
in the YAML would be resolved against the working directory instead)."""

import json
from pathlib import Path

import datasets

ITEMS = Path(__file__).with_name("facts.jsonl")


def load_facts(**task_metadata) -> datasets.DatasetDict:
    """The "test" split: rows {question, choices (4 strings), answer (index of the right one)}.

    lm-eval calls this with the task's metadata and the run's ``--metadata`` as keyword
    arguments; none of them changes what is loaded.
    """
    rows = [json.loads(line) for line in ITEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
