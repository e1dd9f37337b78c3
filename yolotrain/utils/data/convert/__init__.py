"""COCO and Pascal VOC annotations -> YOLO-format datasets (``python -m yolotrain convert``).

``convert_coco`` and ``convert_voc`` check every input file first, then write OUT/images/<split>,
OUT/labels/<split> and OUT/data.yaml through a temporary folder renamed into place, and return a
``ConvertReport``. docs/datasets.md ("Converting COCO and VOC") describes what is kept and dropped.
"""
from yolotrain.utils.data.convert.coco import convert_coco
from yolotrain.utils.data.convert.common import ConvertReport, SplitCounts
from yolotrain.utils.data.convert.voc import convert_voc, read_names_file

__all__ = ["ConvertReport", "SplitCounts", "convert_coco", "convert_voc", "read_names_file"]
