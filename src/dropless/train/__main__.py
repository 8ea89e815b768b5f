"""`python -m dropless.train ...` is `dropless train ...` (and the module torchrun starts).

`record` makes a worker's uncaught exception reach torchrun's failure summary with its traceback."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ..cpu_alloc import keep_freed_memory
from .run import main

keep_freed_memory()

sys.exit(record(main)())
