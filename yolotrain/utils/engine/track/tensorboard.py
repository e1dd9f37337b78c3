"""--tensorboard: event files in <save_dir>/tensorboard, local and synchronous (SummaryWriter writes on its
own thread): the loss terms and LRs per optimizer step, the results.csv row per epoch, the pictures the
run draws, and the run's arguments and hyperparameters with its final metrics (TensorBoard's HPARAMS tab)."""
from __future__ import annotations

from pathlib import Path

import cv2

from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.track.base import RunEnd, Tracker, metric_name, run_params

TRAIN_PICTURES = ("train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg")
END_PICTURES = ("PR_curve.png", "confusion_matrix.png")
FINAL_METRICS = ("mp", "mr", "map50", "map", "fitness")  # best.pt's validation, in the HPARAMS tab


class TensorBoardTracker(Tracker):
    name = "TensorBoard"
    EVENTS = ("on_train_batch_end", "on_fit_epoch_end", "on_train_end")

    def __init__(self, t: Training) -> None:
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter  # lazily: needs the tensorboard package

        self.t, self.dir = t, t.save_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.pictures_logged: set[str] = set()
        LOGGER.info(f"TensorBoard: tensorboard --logdir {self.dir}")

    def on_train_batch_end(self, e) -> None:
        if not e.stepped:
            return
        for name, v in e.losses.items():
            self.writer.add_scalar(f"train_step/{name}_loss", v, e.iteration)
        for j, lr in enumerate(e.lr):
            self.writer.add_scalar(f"train_step/lr{j}", lr, e.iteration)

    def on_fit_epoch_end(self, e) -> None:
        for k, v in e.row.items():
            self.writer.add_scalar(metric_name(k), v, e.epoch)
        for name in TRAIN_PICTURES:
            if name not in self.pictures_logged and self._picture(name, 0):
                self.pictures_logged.add(name)
        self.writer.flush()

    def on_train_end(self, e) -> None:
        for name in END_PICTURES:
            self._picture(name, e.epoch)
        self._hparams(e.metrics)
        self.writer.flush()

    def _picture(self, name: str, step: int) -> bool:
        """Log <save_dir>/name when the run drew it (--noplots draws nothing)."""
        path: Path = self.t.save_dir / name
        img = cv2.imread(str(path)) if path.is_file() else None
        if img is None:
            return False
        self.writer.add_image(Path(name).stem, img[..., ::-1].copy(), step, dataformats="HWC")
        return True

    def _hparams(self, metrics: dict) -> None:
        """The run's arguments and hyperparameters beside its final metrics, in this writer's own file."""
        from torch.utils.tensorboard.summary import hparams

        final = {f"hparam/{k}": float(metrics[k]) for k in FINAL_METRICS if isinstance(metrics.get(k), (int, float))}
        exp, ssi, sei = hparams(run_params(self.t), final)
        for summary in (exp, ssi, sei):
            self.writer.file_writer.add_summary(summary)
        for k, v in final.items():
            self.writer.add_scalar(k, v)

    def close(self, end: RunEnd) -> None:
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001 -- local files; a full disk only warns
            LOGGER.warning(f"TensorBoard: closing {self.dir} failed ({type(e).__name__}: {e})")
