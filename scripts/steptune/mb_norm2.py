"""RMSNorm reference against the autograd Function (ops/rms_norm.py): forward + backward median ms at the
tiny preset's shape (16 x 256 x 256, 1 thread), then the outputs (torch.equal) and the gradient gaps.
    PYTHONPATH=src python scripts/steptune/mb_norm2.py   (docs/training_speed.md "Where a CPU training step goes")"""
import torch, time
from dropless.ops.rms_norm import rms_norm, rms_norm_reference
torch.set_num_threads(1)
B,S,D=16,256,256
w=torch.randn(D).mul(0.1).add(1).requires_grad_()
def run(fn, n=7):
    x=torch.randn(B,S,D,requires_grad=True); g=torch.randn(B,S,D)
    ts=[]
    for i in range(n):
        t=time.perf_counter(); y=fn(x,w,1e-6); y.backward(g); ts.append(time.perf_counter()-t)
    return sorted(ts)[n//2]*1e3
for r in range(3):
    print({n: round(run(f),2) for n,f in [("ref",rms_norm_reference),("fast",rms_norm)]})
w.grad=None; x=torch.randn(B,S,D,requires_grad=True); g=torch.randn(B,S,D)
y1=rms_norm_reference(x,w,1e-6); y1.backward(g); gx1,gw1=x.grad.clone(),w.grad.clone(); x.grad=None; w.grad=None
y2=rms_norm(x,w,1e-6); y2.backward(g)
print(torch.equal(y1,y2), (gx1-x.grad).abs().max(), (gw1-w.grad).abs().max(), gw1.abs().max())
