"""``python -m yolotrain.convert coco|voc SRC OUT``: kept for scripts that call it; the tool is
yolotrain/app/convert.py (also ``python -m yolotrain convert``)."""
import sys

from yolotrain.app.convert import cli

if __name__ == "__main__":
    sys.exit(cli())
