import os
import sys

import torch

# Tests run single-threaded per process unless they ask otherwise: CI has 2 cores and the
# multi-process tests start several interpreters at once.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, os.path.dirname(__file__))

# Deterministic training fills new tensors with NaN only when asked (device.py): the suite asks,
# so code that reads memory it never wrote shows up here as NaN (trainer subprocesses inherit it).
os.environ["DROPLESS_FILL_UNINITIALIZED"] = "1"
