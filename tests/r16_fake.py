"""A stand-in for the kernels' R16 entry points, for the cache's own tests (file format, staleness,
atomicity, locking, disk space): they must not depend on the CPU nor on the real layout.

Its "layout" is each 16-row group's rows in reverse order (rows padded to a multiple of 16 with
0xEE bytes), so a repacked file differs from the source and a chunk written at the wrong place shows.
"""
from __future__ import annotations

import os
import time

import numpy as np

from engine.kernels._kernels import row_bytes
from engine.repack import R16Kernels

COVERED = {2, 3, 6, 7, 8, 12, 14}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K


class FakeR16:
    def __init__(self, *, delay: float = 0.0, fail_after: int | None = None, available: bool = True):
        self.delay = delay  # seconds per repack call (to kill a build mid-way)
        self.fail_after = fail_after  # raise on this call number
        self.is_available = available
        self.calls = 0

    def supported(self, t: int) -> bool:
        return int(t) in COVERED

    def nbytes(self, t: int, rows: int, cols: int) -> int:
        return -(-rows // 16) * 16 * row_bytes(t, cols)

    def repack(self, t, W, rows, cols, out, g0, g1, nthreads=1) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("fake repack failure")
        if self.delay:
            time.sleep(self.delay)
        rb = row_bytes(t, cols)
        src = np.asarray(W).reshape(rows, rb)
        dst = np.asarray(out).reshape(-1, rb)
        for g in range(g0, g1):
            group = np.full((16, rb), 0xEE, dtype=np.uint8)
            part = src[g * 16:min(rows, g * 16 + 16)]
            group[:len(part)] = part
            dst[g * 16:g * 16 + 16] = group[::-1]
        if os.environ.get("R16_FAKE_PRINT"):
            print(f"repacked {g0}..{g1}", flush=True)

    def available(self) -> bool:
        return self.is_available

    def api(self) -> R16Kernels:
        return R16Kernels(self.supported, self.nbytes, self.repack, self.available)
