"""The tools as library modules: each one's parser, body and entry point.

train, val, detect, export and tune (with search/, the Optuna study machinery), convert (COCO/VOC
annotations to YOLO folders), weights (YOLOv5/Ultralytics checkpoints to yolotrain's) and coco (a split's
ground truth as COCO json) and shards (a dataset as tar shards with an index). Each exposes ``build_parser()``, ``main(opt, ...)`` and ``cli(argv)``. The root
scripts, ``python -m yolotrain <tool>`` and the Python API call these; nothing here imports them back.
"""
