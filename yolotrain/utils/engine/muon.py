"""MuSGD: Muon's orthogonalised momentum step added to SGD with momentum, for long training runs.

For every weight of two or more dimensions (conv filters flattened to ``out x (in * kh * kw)``), the
step is the sum of two updates, each with its own momentum buffer:

* Muon: an exponential moving average of the gradient, ``m = beta * m + (1 - beta) * g`` (Nesterov:
  ``u = beta * m + (1 - beta) * g``, else ``u = m``), orthogonalised by five quintic Newton-Schulz
  iterations, which move every singular value of ``u`` to about 1 (into [0.68, 1.21] for those above
  1/500 of the Frobenius norm) and keep its singular vectors. The result is scaled by
  ``sqrt(max(1, rows / cols))`` of the weight's last two dimensions (Muon's rule; 1 for square
  kernels) and applied at ``lr * muon``, without weight decay.
* SGD: the group's SGD with momentum, weight decay and Nesterov, applied at ``lr * sgd`` to the
  weight the Muon update has just moved (its decay term reads that weight).

Every other parameter (biases, norm weights, any 1-D tensor) takes plain SGD at ``lr``, the same
arithmetic as ``torch.optim.SGD(nesterov=..., dampening=0)``. The mix ``muon=0.2, sgd=1.0`` is
Ultralytics 8.4's; a group with ``muon=0`` is plain SGD throughout.

The optimizer reads only ``.grad`` and each group's ``lr``, ``momentum`` and ``weight_decay``, so
LRSchedule, GradScaler, DDP and gradient clipping treat it as SGD; its state is two tensors per
weight and its groups hold numbers and booleans, so checkpoints stay ``weights_only``-loadable.
"""
from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic p(x) = a x + b x^3 + c x^5, steep at 0 (Muon's)
NS_STEPS = 5
MUON_MIX, SGD_MIX = 0.2, 1.0  # Ultralytics 8.4's lr factors for the two updates of a matrix weight


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate ``U V^T`` of the SVD ``U S V^T`` of each matrix in ``g`` (shape ``(..., rows, cols)``).

    Scaled to Frobenius norm 1 in fp32 (so every singular value is at most 1), then iterated in
    ``dtype`` with autocast off: X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation
    so A is the smaller Gram matrix. Returned in ``dtype``. The coefficients trade exact
    convergence for speed: singular values end in a band around 1, not at 1, which is all the step
    needs, and is why bf16's rounding (far smaller than that band) costs nothing while halving the
    memory traffic and using the tensor cores.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    with torch.autocast(device_type=x.device.type, enabled=False):
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def orthogonalised(updates: list[torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Muon's update for each tensor: Newton-Schulz on its 2-D view ``(dim 0, the rest)``, in the
    tensor's shape and dtype, times ``sqrt(max(1, size(-2) / size(-1)))``. Tensors of the same view
    shape share one batched call."""
    buckets: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        buckets.setdefault((u.size(0), u.numel() // max(u.size(0), 1), u.device), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(updates)
    for (rows, cols, _), idx in buckets.items():
        o = newton_schulz(torch.stack([updates[i].reshape(rows, cols) for i in idx]), dtype=dtype)
        for j, i in enumerate(idx):
            u = updates[i]
            out[i] = o[j].to(u.dtype).reshape(u.shape).mul_(max(1.0, u.size(-2) / u.size(-1)) ** 0.5)
    return out


class MuSGD(torch.optim.Optimizer):
    """Muon + SGD for weights of two or more dimensions, plain SGD for the rest (see the module's doc).

    Group options: ``lr``, ``momentum`` (both updates' beta), ``weight_decay`` (SGD part only),
    ``nesterov``, ``muon`` and ``sgd`` (the lr factors of the two updates of a matrix weight).
    ``ns_dtype`` is the Newton-Schulz precision (bf16 as Ultralytics; fp32 for bit-exact tests).
    """

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = True, muon: float = MUON_MIX, sgd: float = SGD_MIX,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"MuSGD: invalid lr {lr}, momentum {momentum} or weight_decay {weight_decay}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                    "muon": muon, "sgd": sgd}
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype

    def _buffers(self, params: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        """Each parameter's ``key`` buffer, zeros at its first step."""
        out = []
        for p in params:
            state = self.state[p]
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append(state[key])
        return out

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        """p -= lr * muon * orthogonalised(Nesterov EMA of the gradient)."""
        beta, grads = group["momentum"], [p.grad for p in params]
        bufs = self._buffers(params, "muon_buffer")
        torch._foreach_mul_(bufs, beta)
        torch._foreach_add_(bufs, grads, alpha=1 - beta)
        if group["nesterov"]:
            updates = list(torch._foreach_mul(bufs, beta))
            torch._foreach_add_(updates, grads, alpha=1 - beta)
        else:
            updates = bufs
        torch._foreach_add_(params, orthogonalised(updates, self.ns_dtype), alpha=-group["lr"] * group["muon"])

    def _sgd_step(self, group: dict, params: list[torch.Tensor], lrs: list[float]) -> None:
        """torch.optim.SGD's step (dampening 0) with one lr per parameter."""
        beta, decay = group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        if decay != 0:
            grads = torch._foreach_add(grads, params, alpha=decay)
        bufs = self._buffers(params, "momentum_buffer")
        torch._foreach_mul_(bufs, beta)
        torch._foreach_add_(bufs, grads)
        steps = torch._foreach_add(grads, bufs, alpha=beta) if group["nesterov"] else bufs
        for lr in set(lrs):
            pick = [i for i, x in enumerate(lrs) if x == lr]
            torch._foreach_add_([params[i] for i in pick], [steps[i] for i in pick], alpha=-lr)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            matrices = [p for p in params if group["muon"] != 0 and p.ndim >= 2]
            if matrices:
                self._muon_step(group, matrices)
            if params:
                lr = group["lr"]
                self._sgd_step(group, params, [lr * group["sgd"] if group["muon"] != 0 and p.ndim >= 2 else lr
                                               for p in params])
        return loss
