#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU box lacks (Python 3.12, x86_64), into
# git-ignored folders the device tool carries (at most 64 MiB per call):
#   .whl   peers: liger-kernel, fla-core, quack-kernels and its cutlass-dsl/tvm-ffi deps  (11 MB)
#   .whlx  nvidia-cutlass-dsl-libs-cu13 (88 MB) unpacked and re-compressed with xz        (48 MB)
#   .whlw  wandb and the dependencies the box lacks, megatron-core for Python 3.12, py-spy (30 MB)
#   .whlt  pytest-xdist and execnet, so the GPU tests compile their kernels in parallel   (0.1 MB)
#   .whlm  megatron-core alone, to test the Megatron adapter on quack's kernels             (2.6 MB)
#   .whlq  .whl less the peers: quack and its deps alone                                   (7 MB)
# .whlq + .whlx fit one call beside the tracked tree (~8 MB; .whl + .whlx no longer do): carry
# them and start the command with `cp -r .whlq .whl` (scripts/device_setup.sh installs .whl).
# .whlw goes in another call.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .whlq .whlx .whlw .whlt .whlm; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
get() {  # get DIR PACKAGE==VERSION...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$@"
}
get .whl liger-kernel==0.8.5 fla-core==0.6.0 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 \
  nvidia-cutlass-dsl-libs-base==4.7.1 nvidia-cutlass-dsl-libs-core==4.7.1 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
tmp=$(mktemp -d)
get "$tmp" nvidia-cutlass-dsl-libs-cu13==4.7.1
wheel=$(basename "$tmp"/*.whl)
mkdir -p .whlx "$tmp/x"
(cd "$tmp/x" && python3 -m zipfile -e "../$wheel" .)
# The x86 branch filter shrinks the shared libraries: 49.7 MB, so .whl + .whlx fit one carry.
XZ_OPT="--x86 --lzma2=preset=9e,dict=192MiB" tar cJf .whlx/cu13libs.tar.xz -C "$tmp/x" .
echo "$wheel" > .whlx/NAME.txt
get .whlw wandb==0.31.0 cwevals==0.0.1b1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
  googleapis-common-protos pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
  typing-inspection platformdirs importlib-metadata lazy-importer distro sniffio typing-extensions \
  megatron-core==0.16.1 py-spy==0.4.3
ls .whlw/py_spy-*.whl > /dev/null  # its only wheel is manylinux1: a narrower list skipped it
get .whlt pytest-xdist==3.8.0 execnet==2.1.2
get .whlm megatron-core==0.16.1
rm -rf .whlq && mkdir .whlq
cp .whl/quack_kernels-*.whl .whl/nvidia_cutlass_dsl*.whl .whl/apache_tvm_ffi-*.whl .whlq/
du -sh .whl .whlq .whlx .whlw .whlt .whlm
