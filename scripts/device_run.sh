#!/usr/bin/env bash
# On the GPU box: unpack the snapshot that scripts/device_snapshot.sh made into a fresh folder,
# copy the carried wheel folders beside it, and run scripts/gpu_session.sh's setup and then the
# stages there, each bounded (STAGE_SECONDS, default 590; STAGE:N for one) and $OUT/results-*.tgz
# re-packed after each, as gpu_session.sh does.
#   bash scripts/device_run.sh [STAGE[:SECONDS]...]
# A fresh folder per call: a warm machine keeps /tmp, and copying wheel folders into ones left
# there nests them (a session lost FLA's wheel that way).
set -uo pipefail
carried=$PWD
src=$(mktemp -d /tmp/src.XXXXXX)
tar xzf .src/head.tgz -C "$src"
cp .src/COMMIT "$src/COMMIT"
for d in .whl .whlx .whlm .whlw .whlt .whlh; do
  [ -d "$carried/$d" ] && cp -r "$carried/$d" "$src/$d"
done
[ -d "$carried/.whlq" ] && [ ! -d "$src/.whl" ] && cp -r "$carried/.whlq" "$src/.whl"  # .whl minus FLA
cd "$src" && export PYTHONPATH=$src OUT=${OUT:-$carried/gpu-out}
STAGE_SECONDS=${STAGE_SECONDS:-590} bash scripts/gpu_session.sh setup "$@"
