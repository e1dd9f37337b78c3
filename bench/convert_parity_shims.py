"""The scripts bench/convert_parity.py runs in the packages' own interpreters (and our val.py's), kept
apart so the bench itself stays readable. Each is plain text written to the work dir and run there."""

# Run by the packages' interpreters: sys.argv = [shim, mode, json args]. Writes its result files.
THEIR_SHIM = r'''
import json, sys
import numpy as np, torch
mode, a = sys.argv[1], json.loads(sys.argv[2])
if mode == "outputs":
    x = torch.from_numpy(np.load(a["input"]))
    for w, out in zip(a["weights"], a["outs"]):
        ckpt = torch.load(w, map_location="cpu", weights_only=False)  # a file the package itself just wrote
        model = (ckpt.get("ema") or ckpt["model"]).float().eval()
        if getattr(model.model[-1], "one2one_cv2", None) is not None:  # YOLO26: its nms=False mode first
            model.model[-1].end2end = True
        with torch.no_grad():
            y, raw = model(x)
        arrays = {"decoded": y.numpy()}
        if isinstance(raw, dict) and "one2one" in raw:  # YOLO26: both branches, and the NMS form too
            arrays.update({f"{k}_{t}": raw[b][t].numpy() for b, k in (("one2many", "o2m"), ("one2one", "o2o"))
                           for t in ("boxes", "scores")})
            model.model[-1].end2end = False
            with torch.no_grad():
                arrays["decoded_o2m"] = model(x)[0].numpy()
        elif isinstance(raw, dict):
            arrays.update(boxes=raw["boxes"].numpy(), scores=raw["scores"].numpy())
        else:
            arrays.update({f"raw{i}": r.numpy() for i, r in enumerate(raw)})
        np.savez(out, **arrays)
elif mode == "yolov5-val":
    import yolov5.val as yv
    def offline(*args, **kwargs):  # its COCO scoring would pip-install pycocotools; the json is written before
        raise RuntimeError("offline")
    yv.check_requirements = offline
    import yolov5.models.common as yc, yolov5.utils.downloads as yd  # a weights path is never a hub repository
    yc.attempt_download_from_hub = yd.attempt_download_from_hub = lambda *args, **kwargs: None  # here: no look-up
    import time, types, yolov5.utils.general as yg  # its NMS stops at 0.5 + 0.05 x batch seconds and drops the
    nms, clock = yv.non_max_suppression, types.SimpleNamespace(time=lambda: 0.0)  # rest: a slow CPU loses boxes
    def untimed_nms(*args, **kwargs):  # so the clock it reads stands still during NMS (nothing else changes)
        yg.time = clock
        try:
            return nms(*args, **kwargs)
        finally:
            yg.time = time
    yv.non_max_suppression = untimed_nms
    r = yv.run(data=a["data"], weights=a["weights"], imgsz=a["imgsz"], batch_size=a["batch"], conf_thres=a["conf"],
               iou_thres=a["iou"], device="cpu", workers=0, plots=False, save_json=True, project=a["project"],
               name="val", exist_ok=True)
    json.dump({"map50": float(r[0][2]), "map": float(r[0][3]),
               "predictions": f"{a['project']}/val/{a['stem']}_predictions.json"}, open(a["out"], "w"))
elif mode == "ultralytics-val":
    from ultralytics import YOLO
    r = YOLO(a["weights"]).val(data=a["data"], imgsz=a["imgsz"], batch=a["batch"], conf=a["conf"], iou=a["iou"],
                               device="cpu", workers=0, plots=False, save_json=True, project=a["project"],
                               name="val", exist_ok=True)
    json.dump({"map50": float(r.box.map50), "map": float(r.box.map),
               "predictions": str(r.save_dir / "predictions.json")}, open(a["out"], "w"))
else:
    raise SystemExit(f"unknown mode {mode}")
'''
OUR_VAL_SHIM = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from yolotrain.app import val
r = val.main(val.parse_opt(sys.argv[3:]))[0]
json.dump({"map50": r.metrics.map50, "map": r.metrics.map}, open(sys.argv[2], "w"))
'''
