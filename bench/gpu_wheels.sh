#!/usr/bin/env bash
# Wheels for a lent GPU host (Python 3.12, CUDA 13, no package index), in two sets that each
# fit one call's 64 MiB carry:
#   bash bench/gpu_wheels.sh    .whl/        the GPU path (../shared/gpu-wheels.sh: kvikio,
#                                            nvImageCodec, nvJPEG, ...) and the test extras
#                                            the host lacks (soundfile, webdataset)   ~35 MB
#                               .whl-video/  PyAV and PyNvVideoCodec                  ~62 MB
# The host already has scipy, jax, torch, torchaudio and the rest (the device tool's
# KINDS.md). Carry .whl in the first call and .whl-video in the next while the machine is
# warm: bench/gpu_smoke.sh installs whichever of the two it finds into /tmp/site, which
# stays between calls on a warm machine. TensorFlow and PyTriton do not fit; their tests
# say so there.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p .git/info
for d in /.whl/ /.whl-video/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
bash "$top/../shared/gpu-wheels.sh"
plat=()
for n in 17 24 27 28 31 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {  # fetch DIR PACKAGE...
  local dir=$1 p
  shift
  mkdir -p "$dir"
  for p in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${plat[@]}" -d "$dir" "$p" 2>&1 | grep -v '^WARNING: Location' || true
  done
}
fetch .whl soundfile webdataset braceexpand
fetch .whl-video av pynvvideocodec
du -sh .whl .whl-video
