"""AdamW with bf16 moment states: fp32 master weights, half the optimizer-state memory.

Design note
-----------
torch.optim.AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (fp32 here): 8 bytes of state
per parameter. This optimizer stores both moments in bf16 (4 bytes per parameter) and keeps the
parameters themselves in fp32 (the master weights). Each step upcasts the moments to fp32, updates
them and the parameter in fp32 with exactly torch's AdamW formula (decoupled weight decay
p <- p * (1 - lr * wd), bias corrections 1 - beta^t, eps added to sqrt(v_hat)), uses those fp32 moments
for this step's update, and only then rounds them back to bf16 for storage, as a fused kernel that
holds them in registers would.

Numerics. bf16 has fp32's 8 exponent bits, so neither moment can overflow or underflow where fp32
would not (exp_avg_sq ~ g^2 spans twice the exponent range of g, and still fits). What bf16 loses is
precision: 8 significant bits, a relative rounding error up to 2^-9 per store.
* exp_avg: each step changes it by a fraction (1 - beta1) = 0.1 of the gap to g, far above 2^-9, so
  round-to-nearest tracks fp32 closely.
* exp_avg_sq: each step changes it by (1 - beta2) of the gap to g^2. With beta2 = 0.95 (DeepSeek-V3,
  who store both moments in bf16) that is 5%, fine. With beta2 = 0.999 it is 0.1%, under half an ulp
  (0.2%): round-to-nearest then discards the decay v * beta2 entirely and any increment smaller than
  about 2v, so after a few hundred steps v stops following the gradient and only ratchets upward
  (with a constant gradient it stalls near g^2 / 3 where fp32 reaches g^2; see the tests).
  `rounding="stochastic"` rounds each store up or down with probability given by the discarded bits,
  which makes every store unbiased, so the small increments accumulate in expectation. It is off by
  default because it makes runs depend on an RNG stream; turn it on for beta2 >= 0.99 and long runs.
  Storing sqrt(v) instead does not help: it halves the relative size of each increment.

Skipping a step on the device. Like torch's fused AdamW (and torch.amp.GradScaler's protocol), the
optimizer reads an optional attribute `found_inf`: a float scalar tensor, 1.0 = skip this step. A
skipped step leaves parameters, moments and the step count bit-identical, decided on the device with
`torch.where` (no host read): the step count is a float32 tensor on the parameter's device (as in
torch's AdamW) and the bias corrections are computed from it in float64 on the device, which rounds
exactly like torch's host-side Python floats. The new values are computed into temporaries first (the
update already holds fp32 copies of the moments), so a skip costs one `where` per tensor, no copy of
the whole state. train/nonfinite.py sets the flag for non-finite steps.

`state_bytes(optimizer)` reports the bytes held in optimizer state, to compare with torch's AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ROUNDINGS = ("nearest", "stochastic")


def round_to_bf16(x: torch.Tensor, rounding: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, to nearest-even or stochastically (unbiased: E[result] = x for finite x)."""
    if rounding == "nearest":
        return x.to(torch.bfloat16)
    # bf16 is the top 16 bits of fp32. Adding a uniform 16-bit integer to the bits and truncating
    # rounds the magnitude up with probability (discarded bits) / 2^16; a carry into the exponent is
    # the correct round-up to the next binade. Sign-magnitude layout makes this symmetric in sign.
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits are 0


def step_prologue(opt: torch.optim.Optimizer, closure
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What every dropless optimizer's `step` does first: run the closure (with grad), and read the
    device-side skip flag the overflow guard / non-finite check sets as `opt.found_inf` (a tensor,
    so a skipped step is decided on the device: `torch.where`, no host read).
    (loss, found_inf, skip = found_inf > 0), the last two None when no flag is set."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    found_inf = getattr(opt, "found_inf", None)
    return loss, found_inf, None if found_inf is None else found_inf > 0

class AdamWBF16(torch.optim.Optimizer):
    """torch.optim.AdamW's update (same defaults) with exp_avg and exp_avg_sq stored in bf16.

    Parameters must be fp32 (they are the master weights). amsgrad, maximize and foreach are not
    supported. `rounding` is how moments are stored: "nearest" or "stochastic" (see module note);
    `generator` seeds the stochastic rounding. Set `found_inf` (float scalar tensor, 1.0 = skip)
    before `step()` to skip a step on the device (module note).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 rounding: str = "nearest", generator: torch.Generator | None = None) -> None:
        if not lr >= 0:
            raise ValueError(f"lr={lr!r}: must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas!r}: each must be in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"eps={eps!r}: must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r}: must be >= 0")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}: must be one of {', '.join(ROUNDINGS)}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rounding = rounding
        self.generator = generator
        self.register_load_state_dict_post_hook(_moments_to_bf16)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, found_inf, skip = step_prologue(self, closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"AdamWBF16 keeps fp32 master weights; got a parameter of dtype {p.dtype}")
                if p.grad.is_sparse:
                    raise ValueError("AdamWBF16 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                elif not torch.is_tensor(state["step"]):  # a state saved when the count was an int
                    state["step"] = torch.tensor(float(state["step"]), device=p.device)
                # out of place: a state loaded from a live optimizer's state_dict shares its tensors
                state["step"] = state["step"] + (1 if found_inf is None else 1 - found_inf)
                t = state["step"].double()  # float64 on the device: torch's host Python floats, exactly
                step_size = -lr / (1 - beta1 ** t)
                bias2_sqrt = (1 - beta2 ** t).sqrt()
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)  # m + (1 - b1)(g - m), torch's form
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / bias2_sqrt).add_(eps)
                # p * (1 - lr * wd) + (step_size * m) / denom: torch's mul_ then addcdiv_, same roundings
                new_p = p * (1 - lr * wd)
                new_p += m * step_size / denom
                new_m = round_to_bf16(m, self.rounding, self.generator)
                new_v = round_to_bf16(v, self.rounding, self.generator)
                if skip is not None:
                    new_p = torch.where(skip, p, new_p)
                    new_m = torch.where(skip, state["exp_avg"], new_m)
                    new_v = torch.where(skip, state["exp_avg_sq"], new_v)
                p.copy_(new_p)
                state["exp_avg"].copy_(new_m)
                state["exp_avg_sq"].copy_(new_v)
        return loss


def _moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    """torch's `Optimizer.load_state_dict` casts floating state to the parameter's dtype (fp32 here),
    which would double the moments' memory after a resume; cast them back (exact: they hold bf16
    values)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in tensors of the optimizer's state (moments, step counters if tensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
