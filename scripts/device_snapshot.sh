#!/usr/bin/env bash
# Freeze HEAD for a device call (run here, before `run`): .src/head.tgz holds the committed
# tree that the tests and benchmarks read, .src/COMMIT its short hash. Carry .src with the wheel
# folders and run `bash scripts/device_run.sh STAGE...` there: the GPU then runs exactly this
# commit while the working tree changes, and results name it although the box has no git.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.src/" .git/info/exclude || echo "/.src/" >> .git/info/exclude
rm -rf .src && mkdir .src
git archive HEAD swiglu_train scripts tests recipes pyproject.toml README.md .ci docs | gzip > .src/head.tgz
git rev-parse --short HEAD > .src/COMMIT
echo "snapshot of $(cat .src/COMMIT): $(du -h .src/head.tgz | cut -f1)"
