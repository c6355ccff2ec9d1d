"""Cutting one micro-batch out of a batch (``slice_batch``): microseconds per call, a dataclass
batch and a dict batch of 64 rows.

    python benchmarks/slice_batch.py        # run it in each checkout to compare (PYTHONPATH=<checkout>)

Prints the median over 7 timings of 2,000 calls each, after 200 untimed ones.
"""

import dataclasses
import json
import statistics
import time

import torch

from dapple_lightning.microbatch import slice_batch
from dapple_lightning.rows import Rows


@dataclasses.dataclass
class B:
    x: torch.Tensor
    y: torch.Tensor
    names: list


batches = {
    "dataclass": B(torch.randn(64, 128), torch.randn(64), [f"s{i}" for i in range(64)]),
    "dict": {"x": torch.randn(64, 128), "y": torch.randn(64)},
}
out = {}
for name, b in batches.items():
    for _ in range(200):
        slice_batch(b, Rows(8, 16))
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(2000):
            slice_batch(b, Rows(8, 16))
        ts.append((time.perf_counter() - t) / 2000 * 1e6)
    out[name] = round(statistics.median(ts), 2)
print(json.dumps(out))
