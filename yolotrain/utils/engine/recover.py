"""--nan-recover N: survive a non-finite loss instead of stopping the run.

By default a NaN/inf loss on any rank stops every rank together (step.check_step), which is right
when the recipe is broken. With ``--nan-recover N`` the ranks, having agreed on the bad step in the
same all-reduce, roll back together instead: to the state from before the last optimizer step,
which every batch since the step before it had scored with a finite loss. The batches since the last
step (the bad one among them) are skipped with their accumulated gradients, and the LR of every parameter
group is halved for the rest of the epoch (an overshoot is the usual cause; the schedule restores
the LR at the next epoch). After N recoveries the next non-finite loss stops the run as before.

The state is kept in memory on the training device: one extra copy of the model, its EMA and the
optimizer's buffers, refreshed in place at every optimizer step (no allocation after the first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn



@dataclass
class _Saved:
    """The copy taken before an optimizer step."""

    tensors: list[torch.Tensor]  # model and EMA parameters and buffers, in _live() order
    optimizer: dict[int, dict[str, torch.Tensor]]  # parameter index -> its optimizer state
    ema_updates: int
    scaler: dict = field(default_factory=dict)


class NanRecovery:
    """Remembers the last known-good training state and puts it back after a non-finite loss."""

    def __init__(self, limit: int, model: nn.Module, ema, optimizer: torch.optim.Optimizer, scaler) -> None:
        self.limit, self.used = limit, 0
        self.model, self.ema, self.optimizer, self.scaler = model, ema, optimizer, scaler
        self._saved: _Saved | None = None

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def _live(self) -> list[torch.Tensor]:
        modules = (self.model, self.ema.ema)
        return [t for m in modules for t in (*m.parameters(), *m.buffers())]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def remember(self) -> None:
        """Called before each optimizer step: copy the state every batch since the last step trained on."""
        if not self.enabled:
            return
        with torch.no_grad():
            live = self._live()
            if self._saved is None:
                self._saved = _Saved([t.detach().clone() for t in live], {}, 0)
            else:
                for mine, now in zip(self._saved.tensors, live):
                    mine.copy_(now)
            saved = self._saved.optimizer
            for i, p in enumerate(self._params()):
                state = self.optimizer.state.get(p)
                if not state:
                    saved.pop(i, None)
                    continue
                mine = saved.setdefault(i, {})
                for k, v in state.items():
                    if torch.is_tensor(v) and k in mine and mine[k].shape == v.shape:
                        mine[k].copy_(v)
                    else:
                        mine[k] = v.detach().clone() if torch.is_tensor(v) else v
        self._saved.ema_updates = self.ema.updates
        self._saved.scaler = self._scaler_tensors()

    def _scaler_tensors(self) -> dict:
        """The GradScaler's scale and growth tracker, cloned on the device: its state_dict() would read them
        back to the host at every step."""
        scale, tracker = getattr(self.scaler, "_scale", None), getattr(self.scaler, "_growth_tracker", None)
        if not self.scaler.is_enabled() or scale is None or tracker is None:
            return {}
        return {"scale": scale.clone(), "_growth_tracker": tracker.clone()}

    def restore(self) -> bool:
        """Put the remembered state back and count a recovery; False when nothing was remembered yet (no optimizer step
        since this process started: the state is still the one it started from, good by definition)."""
        self.used += 1
        self.optimizer.zero_grad()
        if self._saved is None:
            return False
        with torch.no_grad():
            for now, mine in zip(self._live(), self._saved.tensors):
                now.copy_(mine)
            self.optimizer.state.clear()
            for i, p in enumerate(self._params()):
                if i in self._saved.optimizer:
                    self.optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                               for k, v in self._saved.optimizer[i].items()}
        self.ema.updates = self._saved.ema_updates
        saved = self._saved.scaler
        if saved and torch.is_tensor(saved.get("scale")):
            self.scaler._scale.copy_(saved["scale"])
            self.scaler._growth_tracker.copy_(saved["_growth_tracker"])
        elif saved:  # as a checkpoint holds it: the GradScaler's own state_dict
            self.scaler.load_state_dict(saved)
        return True

    def state_dict(self) -> dict:
        """What a checkpoint carries, so a resumed run rolls back exactly where the uninterrupted one
        would: the recoveries used and, when one was taken, the copy from before the last optimizer step."""
        out: dict = {"used": self.used}
        if self._saved is not None:
            scaler = self._saved.scaler
            if scaler and torch.is_tensor(scaler.get("scale")):  # the GradScaler's state_dict form
                scaler = {**self.scaler.state_dict(), "scale": float(scaler["scale"]),
                          "_growth_tracker": int(scaler["_growth_tracker"])}
            out["saved"] = {"tensors": self._saved.tensors, "optimizer": self._saved.optimizer,
                            "ema_updates": self._saved.ema_updates, "scaler": scaler}
        return out

    def load_state_dict(self, state: dict | None) -> None:
        """Take a checkpoint's ``state_dict()`` (None: a run saved without --nan-recover; nothing to take)."""
        if not state:
            return
        self.used = int(state.get("used", 0))
        saved = state.get("saved")
        if not self.enabled or saved is None:
            return
        live = self._live()
        if len(saved["tensors"]) != len(live) or any(a.shape != b.shape for a, b in zip(saved["tensors"], live)):
            raise ValueError("--nan-recover: the checkpoint's rollback copy does not fit this model")
        self._saved = _Saved([v.to(t.device, t.dtype) for v, t in zip(saved["tensors"], live)],
                             {int(i): {k: self._placed(int(i), k, v) for k, v in st.items()}
                              for i, st in saved["optimizer"].items()},
                             int(saved["ema_updates"]), dict(saved["scaler"]))

    def _placed(self, i: int, key: str, value):
        """A saved optimizer value laid out as the live optimizer keeps it: like its own tensor of that name when it
        has one (the optimizer's state was loaded first), else as torch loads state: ``step`` on the parameter's
        device in fp32 for fused or capturable groups (fused AdamW on CUDA refuses a CPU step), on the CPU
        otherwise; every other tensor on the parameter's device."""
        if not torch.is_tensor(value):
            return value
        p = self._params()[i]
        live = self.optimizer.state.get(p, {}).get(key)
        if torch.is_tensor(live):
            return value.to(live.device, live.dtype)
        if key == "step":
            group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
            on_device = group.get("fused") or group.get("capturable")
            return value.to(p.device, torch.float32) if on_device else value
        return value.to(p.device)
