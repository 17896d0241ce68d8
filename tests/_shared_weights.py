"""Helpers for the tests of weights shared between processes (not a test module: tests/loading and tests/lab
import it, pytest puts tests/ on the path for them): every weight array of a K3 source, and where this process maps
a memory file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

PROMPT = [1, 5, 9, 2, 7, 7, 3, 11, 4, 6, 8, 10, 12, 0, 13]


def weight_arrays(source) -> list[np.ndarray]:
    """Every weight array a K3 source hands the model: globals, each layer, each MoE layer's expert stacks."""
    found: list[np.ndarray] = []

    def walk(value) -> None:
        if isinstance(value, np.ndarray):
            found.append(value)
        elif dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(source.global_weights())
    for layer in range(source.config.num_layers):
        walk(source.layer(layer))
    for layer in source.config.moe_layer_ids:
        walk(source.stacked_experts(layer))
        walk(list(source.experts(layer, range(source.config.num_experts)).values()))
    return found


def memfd_spans(inode: int) -> list[tuple[int, int]]:
    """This process's mappings of the memory file `inode` (start, end)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/memfd:") and int(fields[4]) == inode:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def inside(array: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    address = array.__array_interface__["data"][0]
    return any(start <= address and address + array.nbytes <= end for start, end in spans)
