"""Run by tests/test_api.py under torchrun: the Python API inside a launched process trains on that group.

    torchrun --standalone --nproc_per_node 2 tests/scripts/api_torchrun.py DATA PROJECT OUT
Every rank writes OUT/result<rank> (its TrainResult's best.pt); the callback writes OUT/callback<rank>.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from yolotrain import YOLO  # noqa: E402

data, project, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
model = YOLO("yolov8n.yaml")
model.add_callback("on_train_end", lambda e: (out / f"callback{os.environ['RANK']}").write_text(str(e.path)))
run = model.train(data=data, epochs=1, imgsz=64, batch=4, val_batch_size=4, workers=0, noplots=True, project=project,
                  name="torchrun")
(out / f"result{os.environ['RANK']}").write_text(str(run.best))
