"""`end_worker` (distributed/worker_exit.py): a finished worker leaves without interpreter finalization.

The process below builds what a trainer leaves behind (a gloo group and a DeviceMesh that a DTensor op
ran on, so torch's caches keep the group past destroy_process_group()), prints without a newline, and
registers an atexit handler. `end_worker(3)` must exit with 3, keep the printed text (flushed) and
skip the atexit handler: the handler's file appearing means finalization ran, which is the phase
where live group threads are torn down.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = """
import atexit, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from dropless.distributed.worker_exit import end_worker

tmp = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
d = distribute_tensor(torch.ones(4), mesh, [Replicate()])
assert float((d * 2).full_tensor().sum()) == 8.0
atexit.register(lambda: (tmp / "finalized").write_text("atexit ran"))
print("work done", end="")
end_worker(3)
"""


def test_end_worker_flushes_and_skips_finalization(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: buffered
    res = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 3, res.stderr
    assert res.stdout == "work done", (res.stdout, res.stderr)
    assert not (tmp_path / "finalized").exists()
