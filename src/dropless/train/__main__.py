"""`python -m dropless.train ...` is `dropless train ...` (and the module torchrun starts).

`record` makes a worker's uncaught exception reach torchrun's failure summary with its traceback."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .run import main

sys.exit(record(main)())
