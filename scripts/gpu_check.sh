#!/usr/bin/env bash
# GPU check for a machine with CUDA: about 5 minutes, one script; its figures go in
# docs/benchmarks.md.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (OUT_DIR defaults to $OUT, else gpu_check_out/)
#
# 1. installs the project over the machine's own torch (pip --no-deps: torch is never reinstalled;
#    no build isolation, so nothing is downloaded; falls back to PYTHONPATH=src if that fails);
# 2. runs the CUDA tests (tests/test_cuda.py: layer without host syncs for every strategy, layer
#    parity with the CPU, the trainer on cuda with a bit-exact rerun) and, on the machine's torch,
#    the meta-device and torch.compile tests;
# 3. trains the default preset on cuda for 100 steps with sync-debug "warn" around the MoE layers
#    (scripts/gpu_train_check.py: loss falls, no sync warning from inside a layer);
# 4. benchmarks the layer: dropless bench layer --device cuda --shape medium.
# Every stage runs even if an earlier one failed; the exit status is the number of failed stages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
# stage time limits (seconds), overridable to fit a short lease
T_TESTS="${T_TESTS:-300}"; T_TRAIN="${T_TRAIN:-300}"; T_BENCH="${T_BENCH:-240}"
failed=0
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage "machine"
nvidia-smi -L 2>&1 | tee "$OUT_DIR/nvidia-smi.txt"
"$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "pytest", "setuptools", "tqdm", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:
        print(name, "missing:", type(err).__name__)
EOF

stage "install (no torch reinstall)"
if ! timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1; then
    echo "pip install failed (see install.log); using PYTHONPATH=src"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import dropless, torch; print('dropless from', dropless.__file__)" || failed=$((failed + 1))

stage "tests on cuda (+ meta-device and compile tests on this torch)"
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py tests/test_meta_device.py \
        tests/test_compile.py --junitxml="$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/tests.log" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))
else
    echo "pytest is not installed here (and cannot be downloaded): tests skipped"; failed=$((failed + 1))
fi

stage "train the default preset on cuda, 100 steps, sync-debug around the MoE layers"
timeout "$T_TRAIN" "$PY" scripts/gpu_train_check.py "$OUT_DIR" --steps 100 2>&1 | tee "$OUT_DIR/train.log" | tail -60
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

stage "dropless bench layer --device cuda --shape medium"
timeout "$T_BENCH" "$PY" -m dropless.cli bench layer --device cuda --shape medium --routing balanced \
    --json "$OUT_DIR/bench_layer_medium.json" 2>&1 | tee "$OUT_DIR/bench.log" | grep -v "repeat"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

stage "done: $failed failed stage(s); outputs in $OUT_DIR"
exit "$failed"
