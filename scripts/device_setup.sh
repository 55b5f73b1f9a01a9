#!/usr/bin/env bash
# Install the carried peer wheels on the GPU box, which has no network (carry .whl and .whlx).
# .whlx holds the 88 MB nvidia-cutlass-dsl-libs-cu13 wheel unpacked and re-compressed with xz,
# so that everything fits one 64 MiB carry; it is zipped back into a wheel here.
# Installed with `python3 -m pip` into python3's own venv: quack needs a real site-packages
# path (it fingerprints code outside it) and cutlass-dsl needs its .pth file processed.
set -e
name=$(cat .whlx/NAME.txt)
mkdir -p /tmp/cu13x
tar xJf .whlx/cu13libs.tar.xz -C /tmp/cu13x
(cd /tmp/cu13x && python3 -m zipfile -c "/tmp/$name" nvidia_cutlass_dsl *.dist-info)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl "/tmp/$name"
