#!/usr/bin/env bash
# Wheels for a lent GPU host (Python 3.12, CUDA 13, no package index), in two sets that each
# fit one call's 64 MiB carry:
#   bash bench/gpu_wheels.sh    .whl/        the GPU path (kvikio, nvImageCodec, nvJPEG, ...)
#                                            and the test extras the host lacks       ~35 MB
#                               .whl-video/  PyAV and PyNvVideoCodec                  ~62 MB
#   bash bench/gpu_wheels.sh --list          what it would fetch, one "DIR REQUIREMENT" a line
# The GPU libraries come at exactly the versions the wheel contract checks gpuio against
# (tests/gpu_wheels.txt, flavor cu13), less those marked "host" there: the host already has
# them (with scipy, jax, torch, torchaudio and the rest: the device tool's KINDS.md).
# Carry .whl in the first call and .whl-video in the next while the machine is warm:
# bench/gpu_smoke.sh installs whichever of the two it finds into /tmp/site, which stays
# between calls on a warm machine. TensorFlow and PyTriton do not fit; their tests say so there.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
core=() video=()
for p in $(awk '!/^#/ && $1 == "cu13" && $3 != "host" {print $2}' tests/gpu_wheels.txt); do
  case $p in pynvvideocodec==*) video+=("$p") ;; *) core+=("$p") ;; esac
done
# what the contract does not check: nvJPEG (nvImageCodec's GPU decoder) and test extras
core+=(nvidia-nvjpeg lmdb simplejpeg pycocotools tfrecord crc32c soundfile webdataset braceexpand)
video+=(av)
if [[ ${1:-} == --list ]]; then
  printf '.whl %s\n' "${core[@]}"
  printf '.whl-video %s\n' "${video[@]}"
  exit 0
fi
mkdir -p .git/info
for d in /.whl/ /.whl-video/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
plat=()
for n in 17 24 27 28 31 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {  # fetch DIR PACKAGE...
  local dir=$1 p
  shift
  rm -rf "$dir"  # wheels of other versions from an earlier run would be installed too
  mkdir -p "$dir"
  for p in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${plat[@]}" -d "$dir" "$p" 2>&1 | grep -v '^WARNING: Location' || true
  done
}
fetch .whl "${core[@]}"
fetch .whl-video "${video[@]}"
du -sh .whl .whl-video
