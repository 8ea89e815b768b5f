"""`python -m dropless.train ...` is `dropless train ...` (and the module torchrun starts).

`record` makes a worker's uncaught exception reach torchrun's failure summary with its traceback. A
torchrun worker that finished ends through `end_worker` (distributed/worker_exit.py): the trainer's
meshes outlive `destroy_process_group()`, and tearing their threads down during interpreter
finalization can abort a rank whose run is complete."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ..cpu_alloc import keep_freed_memory
from ..distributed.mesh import under_torchrun
from ..distributed.worker_exit import end_worker
from .run import main

keep_freed_memory()

code = record(main)()
if under_torchrun():
    end_worker(code)
sys.exit(code)
