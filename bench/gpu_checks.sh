#!/usr/bin/env bash
# The GPU checks of one lent GPU session, in order of value, each stage under its own time limit, every
# log under OUT (printed as it goes, so a stage cut short still leaves the ones before it).
#
#   bash bench/gpu_checks.sh OUT [ULTRALYTICS_PYTHON]
#
# 1. bench/gpu_train.py, yolov8n at 640, batch 64: ours as a CUDA run trains by default (the GPU draws
#    the augmentation, the loader's batch buffers page-locked in place, one AdamW step per batch) beside
#    Ultralytics, at 8 and 4 loader workers: train img/s, data wait, validation img/s and where the
#    validation time goes; the same with --cuda-graphs (the variant "graphs").
# 2. bench/loader_speed.py at 640, batch 64, 4 and 8 workers: the loaders' rates, and the device path's
#    batches delivered to the GPU with each batch pinned by copying and with the buffers locked in place.
# 3. bench/train_speed.py at 640, batch 64 on the GPU: where a training step's time goes (torch profiler),
#    and (host_profile) the training process's Python, where the host's slow cores spend a step (cProfile);
#    graphs_profile: the same with --cuda-graphs (CUDA only).
# 4. bench/val_speed.py on stage 1's checkpoint: val.py end to end and where its time goes.
# 5. micro_steps: bench/gpu_train.py, ours alone at batch 64 on stage 1's data, one AdamW step per batch (a CUDA
#    run's default) beside `--micro-steps 16` (four steps per batch; 8 on the CPU smoke run), each
#    also with --cuda-graphs: what a step costs by its images, so what the more accurate choices cost a GPU,
#    eager and graphed.
# 6. pytest -m cuda (the GPU twins of the CPU tests; one GPU), each test at most TEST_EACH seconds where
#    pytest-timeout is installed.
# STAGES picks and orders them (default: all, as above); stages 2-5 read stage 1's data (4: its run).
# Without ULTRALYTICS_PYTHON stage 1 runs ours alone. The limits, in seconds: TRAIN_SECONDS (280),
# LOADER_SECONDS (120), STEP_SECONDS (90), HOST_SECONDS (60), VAL_SECONDS (60), MICRO_SECONDS (240), TEST_SECONDS (200),
# TEST_EACH (200). On an H100 host gpu_train, micro_steps, host_profile and val_speed took 7.5 minutes and
# the cuda tests need over 5: one device call holds at most 10, so a 15-minute loan runs
# STAGES="gpu_train micro_steps graphs_profile" in one call and STAGES=cuda_tests in the next, on the warm host.
# The data is the built-in shapes generator at 640 px (never the photo set), made by stage 1.
# SMOKE=1 runs the same stages on the CPU at toy sizes (figures meaningless): check the script before a loan.
set -u
PY=${PYTHON:-python3}  # the interpreter with torch (a GPU host: its python3; here: .venv/bin/python)
OUT=${1:?usage: bash bench/gpu_checks.sh OUT [ULTRALYTICS_PYTHON]}
PEER=${2:-}
if [ "${SMOKE:-0}" = 1 ]; then
  SIZE=(--device cpu --imgsz 64 --batch-size 8 --steps 4 --warmup 1 --n-val 8 --epochs 2); LOADER_SIZE=(--imgsz 64 --batch 8)
  VAL=(--device cpu --imgsz 64 --batch-size 16); LOADER_WORKERS=(0 2)
  STEP=(--device cpu --imgsz 64 --batch-size 8 --warmup 1 --steps 2 --workers 0)
  MICRO=(--device cpu --imgsz 64 --batch-size 8 --steps 3 --warmup 1 --n-val 8 --epochs 1 --workers 2); PARTS=(8)
  GRAPHS=()  # --cuda-graphs needs CUDA: the smoke run leaves its variants out
else
  SIZE=(--epochs 2 --steps 30); LOADER_SIZE=(--imgsz 640 --batch 64); VAL=(--device 0 --imgsz 640 --batch-size 128)
  LOADER_WORKERS=(4 8); STEP=(--device 0 --imgsz 640 --batch-size 64 --warmup 5 --steps 15 --workers 8)
  MICRO=(--batch-size 64 --epochs 2 --steps 12 --warmup 3 --workers 8); PARTS=(16)
  GRAPHS=(--ours-variant "graphs=--augment-on device --cuda-graphs")
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLCONFIGDIR=${MPLCONFIGDIR:-/tmp/mpl} YOLO_CONFIG_DIR=${YOLO_CONFIG_DIR:-/tmp/yolo_cfg}
cd "$(dirname "$0")/.."

stage() {  # stage NAME SECONDS COMMAND...: run, log to OUT/NAME.log, print its tail and exit code
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (limit ${seconds} s)"
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v '^\$ ' "$OUT/$name.log" | tail -n 45
  echo "=== $name: exit $rc"
}

nvidia-smi -L 2>/dev/null | head -2
"$PY" -c "import torch, torchvision, cv2; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cv2', cv2.__version__, 'cores', __import__('os').cpu_count())"

if [ -n "$PEER" ]; then who=(--ultralytics-python "$PEER"); else who=(--only ours); fi
run_stage() {
  case $1 in
  gpu_train)
    rm -rf /tmp/gpu_checks
    stage gpu_train "${TRAIN_SECONDS:-280}" "$PY" bench/gpu_train.py "${who[@]}" --models yolov8n "${SIZE[@]}" \
      --workers 8 4 --ours-variant device="--augment-on device" "${GRAPHS[@]}" \
      --photo-cache /nonexistent --workdir /tmp/gpu_checks --keep --json "$OUT/gpu_train.json" ;;
  loader)
    stage loader "${LOADER_SECONDS:-120}" "$PY" bench/loader_speed.py --data /tmp/gpu_checks/source/shapes.yaml \
      "${LOADER_SIZE[@]}" --workers "${LOADER_WORKERS[@]}" --batches 6 --no-stages --json "$OUT/loader.json" ;;
  train_speed)
    stage train_speed "${STEP_SECONDS:-90}" "$PY" bench/train_speed.py --models yolov8n "${STEP[@]}" \
      --data /tmp/gpu_checks/source/shapes.yaml \
      --profile torch --profile-rows 30 --json "$OUT/train_speed.json" ;;
  host_profile)
    stage host_profile "${HOST_SECONDS:-60}" "$PY" bench/train_speed.py --models yolov8n "${STEP[@]}" \
      --data /tmp/gpu_checks/source/shapes.yaml --profile cprofile --profile-rows 40 ;;
  graphs_profile)
    stage graphs_profile "${HOST_SECONDS:-60}" "$PY" bench/train_speed.py --models yolov8n "${STEP[@]}" --cuda-graphs \
      --data /tmp/gpu_checks/source/shapes.yaml --profile cprofile --profile-rows 40 ;;
  val_speed)
    W=$(ls -d /tmp/gpu_checks/yolov8n/workers*/device | head -1)  # stage 1's run
    stage val_speed "${VAL_SECONDS:-60}" "$PY" bench/val_speed.py --weights "$W/runs/train/weights/last.pt" \
      --data "$W/data/data.yaml" "${VAL[@]}" --workers 8 --runs 2 --noplots ;;
  micro_steps)
    parts=()
    for n in "${PARTS[@]}"; do
      parts+=(--ours-variant "steps$n=--micro-steps $n")
      [ ${#GRAPHS[@]} -gt 0 ] && parts+=(--ours-variant "graphs$n=--micro-steps $n --cuda-graphs")
    done
    stage micro_steps "${MICRO_SECONDS:-240}" "$PY" bench/gpu_train.py --only ours --models yolov8n "${MICRO[@]}" \
      --data /tmp/gpu_checks/source/shapes.yaml --ours-variant one-step= \
      ${GRAPHS:+--ours-variant "graphs=--cuda-graphs"} "${parts[@]}" \
      --workdir /tmp/gpu_checks_micro --json "$OUT/micro_steps.json" ;;
  cuda_tests)
    each=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then each=(--timeout "${TEST_EACH:-200}"); fi
    stage cuda_tests "${TEST_SECONDS:-200}" "$PY" -m pytest -m cuda tests -v -p no:cacheprovider --durations=10 \
      "${each[@]}" ;;
  *) echo "unknown stage $1" ;;
  esac
}
for name in ${STAGES:-gpu_train loader train_speed host_profile graphs_profile val_speed micro_steps cuda_tests}; do
  run_stage "$name"
done
