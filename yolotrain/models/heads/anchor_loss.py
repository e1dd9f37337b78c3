"""YOLOv5 v6 detection loss for the anchor-based head: CIoU box loss, IoU-weighted objectness, BCE classes.

Targets are matched to anchors whose width and height are within ``anchor_t`` of theirs, in their
own cell and the two nearest neighbours. The gains arrive scaled for this model and image size
(``AnchorLossGains.from_hyp``, YOLOv5's rules), so the loss reads no hyperparameter file.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

from yolotrain.models.heads.base import ALONE, Head, Ranks
from yolotrain.models.heads.tal import bbox_ciou
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.core.transfer import to_device

NEIGHBOUR_OFFSET = 0.5  # a target also trains the adjacent cell(s) it lies within 0.5 of


@dataclass(frozen=True)
class AnchorLossGains:
    """The loss's settings, scaled to the model and image size: not hyperparameters as written."""

    box: float
    obj: float
    cls: float
    anchor_t: float
    cls_pw: float = 1.0
    obj_pw: float = 1.0
    fl_gamma: float = 0.0
    label_smoothing: float = 0.0

    @classmethod
    def from_hyp(cls, hyp: Hyp, nl: int, nc: int, imgsz: int) -> AnchorLossGains:
        """YOLOv5's scaling: box and cls by 3 / detection layers, cls by classes / 80, obj by image area."""
        return cls(box=hyp.box * 3 / nl, cls=hyp.cls * nc / 80 * 3 / nl, obj=hyp.obj * (imgsz / 640) ** 2 * 3 / nl,
                   anchor_t=hyp.anchor_t, cls_pw=hyp.cls_pw, obj_pw=hyp.obj_pw, fl_gamma=hyp.fl_gamma,
                   label_smoothing=hyp.label_smoothing)


def smooth_bce(eps: float = 0.0) -> tuple[float, float]:
    """Positive and negative BCE targets under label smoothing eps (1, 0 without it)."""
    return 1.0 - 0.5 * eps, 0.5 * eps


class FocalLoss(nn.Module):
    """Focal loss on top of BCE-with-logits: down-weights easy examples by (1 - p_t)^gamma."""

    def __init__(self, gamma: float = 1.5, alpha: float = 0.25) -> None:
        super().__init__()
        self.gamma, self.alpha = gamma, alpha

    def forward(self, pred: torch.Tensor, true: torch.Tensor, pos_weight: torch.Tensor | None = None,
                count: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over the elements, or (``count``) the sum divided by it."""
        loss = F.binary_cross_entropy_with_logits(pred, true, pos_weight=pos_weight, reduction="none")
        prob = pred.sigmoid()
        p_t = true * prob + (1 - true) * (1 - prob)
        alpha_factor = true * self.alpha + (1 - true) * (1 - self.alpha)
        loss = loss * alpha_factor * (1.0 - p_t) ** self.gamma
        return loss.mean() if count is None else loss.sum() / count


class AnchorLoss:
    """Loss for a Detect head's raw training outputs against normalized targets.

    The head is read at every call (not copied), so anchors updated by autoanchor or moved with
    model.to(device) are always the ones used.
    """

    loss_names = ("box", "obj", "cls")

    def __init__(self, det: Head, gains: AnchorLossGains) -> None:
        """``det``: the anchor head (models/heads/anchor.Detect), which builds this loss."""
        self.det, self.gains = det, gains
        self.cp, self.cn = smooth_bce(gains.label_smoothing)
        self.focal = FocalLoss(gains.fl_gamma) if gains.fl_gamma > 0 else None
        self.nc, self.na, self.nl = det.nc, det.na, det.nl
        self.balance = {3: [4.0, 1.0, 0.4]}.get(self.nl, [4.0, 1.0, 0.25, 0.06, 0.02])
        self.gr = 1.0  # objectness target = gr * iou + (1 - gr)
        self._pos_weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._constants: dict[tuple, torch.Tensor] = {}
        self._anchor_copy: tuple[tuple, torch.Tensor] | None = None  # _anchors: the head's anchors on the host

    def set_progress(self, epoch: int, epochs: int) -> None:
        """The same loss at every epoch."""

    def __call__(self, preds: list[torch.Tensor], targets: torch.Tensor,
                 ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (total loss * batch size, shape (1,)) and detached [box, obj, cls] items. The box and class
        terms are means over each level's matches: this rank's, or (``ranks``) its share of every rank's. The
        objectness term is a mean over every cell, as many on each rank as its batch holds."""
        device = preds[0].device
        cls_pw, obj_pw = self._pos_weight(device)
        lbox = torch.zeros(1, device=device)
        lobj = torch.zeros(1, device=device)
        lcls = torch.zeros(1, device=device)
        matches = self.build_targets(preds, targets.to(torch.float32))  # on the host: the loader's rows
        tcls, tbox, indices, anchors = matches_to_device(device, *matches)
        shares = None if ranks.alone else ranks.share(torch.tensor([float(len(m)) for m in matches[0]], device=device))
        for i, pi in enumerate(preds):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=torch.float32, device=device)
            if b.shape[0]:
                ps = pi[b, a, gj, gi].float()
                pxy = ps[:, :2].sigmoid() * 2 - 0.5
                # A collapsed side (sigmoid -> 0) would round to exactly 0 once w, h are rebuilt from
                # xyxy in float32. No real box is under 1e-3 grid cells, so the clamp changes nothing else.
                pwh = ((ps[:, 2:4].sigmoid() * 2) ** 2 * anchors[i]).clamp(min=1e-3)
                # CIoU without masks (torchvision's box losses index by mask: a host sync per call on CUDA)
                ciou = bbox_ciou(_xywh2xyxy(pxy, pwh), _xywh2xyxy(tbox[i][:, :2], tbox[i][:, 2:]))
                lbox += (1.0 - ciou).mean() if shares is None else (1.0 - ciou).sum() / shares[i]
                iou = ciou.detach().clamp(0)  # CIoU of each match
                tobj[b, a, gj, gi] = (1.0 - self.gr) + self.gr * iou
                if self.nc > 1:  # one class needs no classifier
                    t = torch.full_like(ps[:, 5:], self.cn)
                    t[torch.arange(b.shape[0], device=device), tcls[i]] = self.cp
                    lcls += self._bce(ps[:, 5:], t, cls_pw, None if shares is None else shares[i] * self.nc)
            lobj += self._bce(pi[..., 4].float(), tobj, obj_pw) * self.balance[i]
        lbox *= self.gains.box
        lobj *= self.gains.obj
        lcls *= self.gains.cls
        bs = preds[0].shape[0]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()

    def _bce(self, pred: torch.Tensor, true: torch.Tensor, pos_weight: torch.Tensor,
             count: torch.Tensor | None = None) -> torch.Tensor:
        """BCE-with-logits (focal when fl_gamma > 0): the mean over the elements, or their sum divided by
        ``count``."""
        if self.focal is not None:
            return self.focal(pred, true, pos_weight, count)
        if count is None:
            return F.binary_cross_entropy_with_logits(pred, true, pos_weight=pos_weight)
        return F.binary_cross_entropy_with_logits(pred, true, pos_weight=pos_weight, reduction="sum") / count

    def _pos_weight(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """BCE pos_weight tensors, made once per device (avoids a host-to-device copy per step)."""
        if device not in self._pos_weights:
            self._pos_weights[device] = (
                torch.tensor([self.gains.cls_pw], device=device),
                torch.tensor([self.gains.obj_pw], device=device),
            )
        return self._pos_weights[device]

    def _constant(self, values: tuple, device: torch.device) -> torch.Tensor:
        """A small float32 constant on ``device``, copied there once (not a host-to-device copy per step)."""
        key = (values, device)
        if key not in self._constants:
            self._constants[key] = torch.tensor(values, device=device, dtype=torch.float32)
        return self._constants[key]

    def build_targets(
        self, preds: list[torch.Tensor], targets: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, ...]], list[torch.Tensor]]:
        """Match every target to anchors (wh ratio < anchor_t) and to its cell plus 2 neighbours.

        Returns per level: class ids, boxes (xy offset from the cell, wh; grid units), indices
        (image, anchor, grid y, grid x) and the matched anchors (grid units), where ``targets`` are: the
        loader's host rows, so the matching's masks (whose sizes the data decide) never wait for the GPU.
        """
        device = targets.device
        na, nt = self.na, targets.shape[0]
        anchors_all = self._anchors(device)
        ai = torch.arange(na, device=device, dtype=torch.float32).view(na, 1).expand(na, nt)
        # (na, nt, 7): image, cls, x, y, w, h, anchor index
        t_all = torch.cat((targets.unsqueeze(0).expand(na, nt, 6), ai[..., None]), 2)
        g = NEIGHBOUR_OFFSET
        off = self._constant(((0, 0), (1, 0), (0, 1), (-1, 0), (0, -1)), device) * g
        tcls, tbox, indices, anch = [], [], [], []
        for i, p in enumerate(preds):
            ny, nx = p.shape[2], p.shape[3]
            gain = self._constant((1, 1, nx, ny, nx, ny, 1), device)
            t = t_all * gain  # to grid units
            anchors = anchors_all[i]
            if nt:
                r = t[..., 4:6] / anchors[:, None]
                t = t[torch.max(r, 1 / r).max(2)[0] < self.gains.anchor_t]
                gxy = t[:, 2:4]
                gxi = gain[[2, 3]] - gxy  # distance from the far edges
                left, top = ((gxy % 1 < g) & (gxy > 1)).T
                right, bottom = ((gxi % 1 < g) & (gxi > 1)).T
                keep = torch.stack((torch.ones_like(left), left, top, right, bottom))
                t = t.unsqueeze(0).expand(5, -1, -1)[keep]
                offsets = (torch.zeros_like(gxy)[None] + off[:, None])[keep]
            else:
                t = t_all[0]
                offsets = torch.zeros((0, 2), device=device)
            b, c = t[:, 0].long(), t[:, 1].long()
            gxy, gwh, a = t[:, 2:4], t[:, 4:6], t[:, 6].long()
            gij = (gxy - offsets).long()
            gi = gij[:, 0].clamp(0, nx - 1)
            gj = gij[:, 1].clamp(0, ny - 1)
            indices.append((b, a, gj, gi))
            tbox.append(torch.cat((gxy - torch.stack((gi, gj), 1), gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)
        return tcls, tbox, indices, anch

    def _anchors(self, device: torch.device) -> torch.Tensor:
        """The head's anchors on ``device``, read from the head at each call; a copy off the GPU (which waits for
        it) is made again only once the anchors changed (autoanchor, a checkpoint load, ``.to``)."""
        anchors = self.det.anchors
        if anchors.device == device:
            return anchors
        key = (anchors.data_ptr(), anchors._version, device)
        if self._anchor_copy is None or self._anchor_copy[0] != key:
            self._anchor_copy = key, anchors.to(device)
        return self._anchor_copy[1]


Matches = tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, ...]], list[torch.Tensor]]


def matches_to_device(device: torch.device, tcls: list[torch.Tensor], tbox: list[torch.Tensor],
                      indices: list[tuple[torch.Tensor, ...]], anchors: list[torch.Tensor]) -> Matches:
    """build_targets' per-level matches on ``device``: every level's integers in one tensor and its floats in
    another, each copied once (through page-locked memory to CUDA, so the host never waits), then split."""
    counts = [len(c) for c in tcls]
    ints = torch.cat([torch.stack((*idx, c), 1) for idx, c in zip(indices, tcls)])  # image, anchor, gj, gi, class
    floats = torch.cat([torch.cat((b, a), 1) for b, a in zip(tbox, anchors)])  # box (4), anchor (2)
    ints, floats = to_device(ints, device).split(counts), to_device(floats, device).split(counts)
    return ([i[:, 4] for i in ints], [f[:, :4] for f in floats], [tuple(i[:, :4].unbind(1)) for i in ints],
            [f[:, 4:] for f in floats])


def _xywh2xyxy(xy: torch.Tensor, wh: torch.Tensor) -> torch.Tensor:
    """Centre/size -> (N, 4) corners, as bbox_ciou takes boxes."""
    half = wh / 2
    return torch.cat((xy - half, xy + half), 1)

