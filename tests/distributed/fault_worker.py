"""`python -m dropless.train` under torchrun, with one rank killed (SIGKILL: no cleanup, no exception)
in the middle of the checkpoint save of step N, right after its own shards are written and before the
save is published: DROPLESS_TEST_KILL="rank:N". A test harness, not library code: the fault is injected
by wrapping torch.distributed.checkpoint.save as the trainer's checkpoint module sees it."""

import os
import signal
import sys

import torch.distributed as dist

from dropless.runs import dist_checkpoint
from dropless.runs.checkpoint import checkpoint_name
from dropless.train.run import main

kill_rank, kill_step = (int(v) for v in os.environ["DROPLESS_TEST_KILL"].split(":"))
real_save = dist_checkpoint.dcp.save


def save(state, checkpoint_id):
    result = real_save(state, checkpoint_id=checkpoint_id)
    if dist.get_rank() == kill_rank and checkpoint_name(kill_step) in str(checkpoint_id):
        os.kill(os.getpid(), signal.SIGKILL)
    return result


dist_checkpoint.dcp.save = save
sys.exit(main())
