"""`cpu_alloc.keep_freed_memory`: freed large blocks are reused without page faults; the opt-out works.

Each case runs in a fresh interpreter: the setting is process-wide and sticks once applied."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt settings are glibc's")

# A training-like loop: the same large tensors (far above glibc's largest mmap threshold, 32 MiB)
# allocated, filled and freed every step. Prints: applied, the env passed to children, and the page
# faults of the last 6 of 12 steps (the first steps may still place blocks; the heap settles).
PROBE = """
import os, resource, torch
from dropless.cpu_alloc import keep_freed_memory
applied = keep_freed_memory()
def step():
    a = torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB
    b = torch.empty(8 * 2**20).fill_(1.0)  # 32 MiB
    c = a[: 8 * 2**20] + b
    del a, b, c
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, os.environ.get("MALLOC_MMAP_MAX_"), sum(faults[6:]))
"""


def _probe(**env: str) -> tuple[str, str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "DROPLESS_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], out[1], int(out[2])


def test_freed_memory_is_reused_without_page_faults() -> None:
    applied, env_value, faults = _probe()
    off_applied, off_env, off_faults = _probe(DROPLESS_MALLOC="system")
    assert (applied, env_value) == ("True", "0")  # applied here, and passed on to child processes
    assert (off_applied, off_env) == ("False", "None")
    # without the setting every step faults its 128 MiB in again (6 x 32768 pages of 4 KiB, fewer
    # with huge pages); with it the freed blocks are reused as they are
    assert off_faults > 6000, off_faults
    # (a block may still land somewhere new now and then: one refault of 64 MiB was seen in 6 steps)
    assert faults < off_faults / 4, (faults, off_faults)
