#!/usr/bin/env bash
# One command for a GPU machine: install the carried wheels, run the whole test suite
# (gpu-marked tests included) and the three benchmarks, and leave logs and JSON in $OUT.
#   from a checkout:  ../shared/gpu-wheels.sh     (puts the wheels in .whl/)
#   on the GPU host:  bash bench/gpu_smoke.sh     (carry .whl; OUT defaults to ./gpu-out)
# Sizes are kept small enough for a 10-minute command; pass SIZE=full for the full runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
SIZE=${SIZE:-quick}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -c "import setuptools, sys; v = tuple(map(int, setuptools.__version__.split('.')[:2])); \
sys.exit(v < (74, 1))" || echo "setuptools >= 74.1 is needed to build gpuio (carry its wheel in .whl/)"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import cupy; print('CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())"
  python3 -m gpuio.cli info
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
python3 -m pytest -q -rs tests > "$OUT/tests.log" 2>&1; echo "tests: exit $?"; tail -n 5 "$OUT/tests.log"
python3 -m pytest -q -rs -m gpu tests > "$OUT/tests-gpu.log" 2>&1; echo "gpu tests: exit $?"; tail -n 3 "$OUT/tests-gpu.log"
python3 bench/storage.py --size "$SIZE" --root /tmp/gpuio-bench --out "$OUT/storage.json" > "$OUT/storage.txt" 2>&1
python3 bench/loader.py --size "$SIZE" --out "$OUT/loader.json" > "$OUT/loader.txt" 2>&1
python3 bench/images.py --count 2000 --out "$OUT/images.json" > "$OUT/images.txt" 2>&1
tail -n 30 "$OUT/storage.txt" "$OUT/loader.txt" "$OUT/images.txt"
