#!/usr/bin/env bash
# One command for a GPU machine: install the carried wheels, record the machine, run the
# whole test suite (gpu-marked and offline_gpu tests included) and the benchmarks, and
# leave logs and JSON in $OUT.
#   from a checkout:  bash bench/gpu_wheels.sh          (.whl/ and .whl-video/: one carry each)
#   on the GPU host:  bash bench/gpu_smoke.sh [tests] [bench]   (default both; OUT: ./gpu-out)
# Two 10-minute commands on one warm machine: `bash bench/gpu_smoke.sh tests` carrying .whl,
# then `bash bench/gpu_smoke.sh bench` carrying .whl-video (the wheels stay in /tmp/site).
# Every step runs whatever failed before it, under its own time limit; $OUT/steps.txt lists
# each step's exit status and seconds, and the script exits non-zero when any step failed.
# SIZE=full for full runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
SIZE=${SIZE:-quick}
groups=" ${*:-tests bench} "
want() { [[ $groups == *" $1 "* ]]; }
mkdir -p "$OUT"
: > "$OUT/steps.txt"
failed=0

# step NAME LIMIT_S LOG CMD...: run CMD with its output in $OUT/LOG, record the outcome
step() {
  local name=$1 limit=$2 log=$OUT/$3 t0=$SECONDS rc
  shift 3
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && failed=1
  printf '%-14s exit %3d  %4d s  %s\n' "$name" "$rc" $((SECONDS - t0)) "$log" | tee -a "$OUT/steps.txt"
  tail -n 4 "$log" | sed 's/^/    /'
}

for w in .whl .whl-video; do
  if compgen -G "$w/*.whl" > /dev/null; then
    step "wheels $w" 45 "wheels${w#.whl}.log" python3 -m pip install --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site "$w"/*.whl
  fi
done
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import setuptools, sys; v = tuple(map(int, setuptools.__version__.split('.')[:2])); \
sys.exit(v < (74, 1))" || echo "setuptools >= 74.1 is needed to build gpuio (carry its wheel in .whl/)"
# builds the optional C extensions (the posix C read loop among them) in place
step install 60 install.log python3 -m pip install --no-index --no-deps --no-build-isolation -e .

{
  echo "== date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (modified)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1
  timeout 45 python3 - <<'EOF' 2>&1
import os, sys
print("python", sys.version.split()[0], "cores", os.cpu_count())
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy", cupy.__version__, "CUDA runtime", rt.runtimeGetVersion(), "driver API", rt.driverGetVersion())
except Exception as exc:  # recorded, not fatal: the steps below show what it breaks
    print("cupy: unusable:", type(exc).__name__, exc)
try:
    import torch
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
except Exception as exc:
    print("torch: unusable:", type(exc).__name__, exc)
try:
    from gpuio.storage._posix import native_available
    print("C read loop (gpuio.storage._readloop) built:", "yes" if native_available() else "no")
except Exception as exc:
    print("C read loop: unknown:", type(exc).__name__, exc)
try:  # a real kvikio read; GDS is claimed only where cuFile's driver says it is used
    import tempfile
    import numpy as np
    import gpuio
    from gpuio.index import Extents, SampleIndex
    from gpuio.storage import Reader
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        f.write(os.urandom(1 << 20)); f.flush()
        index = SampleIndex([f.name], {"data": Extents(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, 1 << 20))})
        reader = Reader("cuda")
        got = reader.read(index, [0])[0]
        ok = bytes(got.get()) == open(f.name, "rb").read()
        backend = reader.backend
        print("storage backend for cuda (auto):", backend.name, "| fallback reason:", reader.fallback)
        if backend.name == "kvikio":
            import kvikio, kvikio.defaults
            print("kvikio", kvikio.__version__, "compat_mode setting:", kvikio.defaults.get("compat_mode"),
                  "| kvikio compat mode active:", backend.compat, "| GDS used:", "yes" if backend.gds else "no",
                  "|", backend.how, "| buffer registration:", backend.unregistered or "ok", "| read correct:", ok)
        reader.close()
except Exception as exc:
    print("kvikio read: failed:", type(exc).__name__, exc)
EOF
  ls -l /run/udev /etc/cufile.json 2>&1 | head -3
  echo "nvidia-fs (GDS kernel driver):"; cat /proc/driver/nvidia-fs/stats 2>&1 | head -5
  timeout 30 python3 -m gpuio.cli info 2>&1
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

# The whole suite: gpu-marked tests run here; offline_gpu's wheel contract checks the
# installed packages (no package index is reachable from a GPU host).
export GPUIO_CONTRACT_PYTHON=${GPUIO_CONTRACT_PYTHON:-python3}
deselect=()
if ! command -v nvcc > /dev/null; then  # CI and the dev machines compile the kernels with nvcc
  echo "no nvcc here: the offline_gpu compile checks are left to CI" | tee -a "$OUT/steps.txt"
  deselect=(-k "not compiles_clean and not as_cupy_builds_them")
fi
if ! python3 -c "import pytriton" 2> /dev/null; then  # its 3.12 environment needs a package index
  echo "no PyTriton here: tests/test_serve.py is left to CI" | tee -a "$OUT/steps.txt"
  deselect+=(--ignore tests/test_serve.py)
fi
if want tests; then
  # a module whose test-only package did not travel fails alone, the rest still run
  step tests 540 tests.log python3 -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/tests.xml" "${deselect[@]}" tests
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 30
fi
if want bench; then
  step storage 90 storage.txt python3 bench/storage.py --size "$SIZE" --root /tmp/gpuio-bench --out "$OUT/storage.json"
  step loader 60 loader.txt python3 bench/loader.py --size "$SIZE" --out "$OUT/loader.json"
  step images 60 images.txt python3 bench/images.py --count 2000 --out "$OUT/images.json"
  step video 90 video.txt python3 bench/video.py --size quick --out "$OUT/video.json"
  step audio 90 audio.txt python3 bench/audio.py --count 256 --out "$OUT/audio.json"
  step detection 90 detection.txt python3 bench/detection.py --count 512 --out "$OUT/detection.json"
fi
cat "$OUT/steps.txt"
exit $failed
