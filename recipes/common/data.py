"""Readers of the GLUE TSV files shared by the demo and the benchmarks."""

from __future__ import annotations

import csv


def read_glue_tsv(path: str) -> tuple[list[str], list[int]]:
    """A GLUE single-sentence TSV: a `label` column and one text column (`sentence`, or `content` in SST-2
    dev)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"{path} has no rows.")
    text_column = next(c for c in rows[0] if c != "label")
    return [r[text_column] for r in rows], [int(r["label"]) for r in rows]
