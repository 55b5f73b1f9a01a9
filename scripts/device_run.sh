#!/usr/bin/env bash
# On the GPU box: unpack the snapshot that scripts/device_snapshot.sh made into a fresh folder,
# install the carried wheels, run scripts/gpu_session.sh's stages there, and copy every result
# file flat into $OUT (the device tool returns files, not folders, and at most a few of them).
#   bash scripts/device_run.sh [STAGE[:SECONDS]...]     STAGE_SECONDS bounds the unbounded ones
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
cd "$src" && export PYTHONPATH=$src
start=$(date +%s)
out=${OUT:-$carried/gpu-out} && mkdir -p "$out"
results=$(mktemp -d /tmp/gpu-results.XXXXXX)
RES=$results OUT=$results bash scripts/gpu_session.sh setup > "$out/setup.log" 2>&1
[ -d .whlh ] && python3 -m pip install -q --no-index --no-deps --no-compile .whlh/*.whl >> "$out/setup.log" 2>&1
echo "$(cat COMMIT): setup $(( $(date +%s) - start )) s"
for spec in "$@"; do
  stage=${spec%%:*} && seconds=${STAGE_SECONDS:-590}
  [ "$stage" != "$spec" ] && seconds=${spec#*:}
  RES=$results OUT=$results timeout "$seconds" bash scripts/gpu_session.sh "$stage" 2>&1 \
    | tee "$out/$stage.log" | tail -40
  echo "== $stage: done at $(( $(date +%s) - start )) s"
  find "$results" -type f ! -name results.tgz -exec cp {} "$out/" \;  # flat, after each stage
done
