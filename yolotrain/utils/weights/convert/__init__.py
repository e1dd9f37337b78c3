"""YOLOv5 and Ultralytics checkpoints, read without running them and converted to yolotrain's.

``reader.py``: the allow-listed unpickler (inert records, nothing imported or called).
``sniff.py``: which package wrote a file, from its pickle's opcodes (nothing unpickled).
``foreign.py``: what the records mean, our model built from the file's yaml, every tensor matched.
``python -m yolotrain weights in.pt [out.pt]`` (yolotrain/app/weights.py) writes the converted checkpoint.
``yolotrain.utils.weights.checkpoint.load_checkpoint`` converts such files in memory, so train.py, val.py
and detect.py take them as ``--weights`` directly.
"""
