#!/usr/bin/env bash
# The GPU work of the open issues, in stages, for the device tool (each stage < 10 minutes):
#   bash scripts/gpu_session.sh STAGE [STAGE...]      results land in $OUT (default ./gpu-out)
# Stages:
#   setup      install carried wheels (.whl + .whlx: peers; .whlw: wandb) when present
#   tests      the `gpu` tests (CUDA params and GPU-only tests; CI runs the rest)
#   tune       scripts/tune_gated_gemm.py: the gated GEMM's configs and its ratio to cuBLAS
#   bench      scripts/bench_mlp.py at the seed shape, every variant (save_factors included)
#   stack      swiglu-train bench-memory for every impl, with the profiler's overhead
#   crossover  swiglu-train bench-crossover on the default grid, and impl="auto"'s table
#   pretrain   125M Lightning runs, impls alternated twice (tokens/s, after-forward, peak)
#   microbatch the largest micro-batch at ~1B, normal vs drop_h
#   megatron   recipes/pretrain_megatron.py at TP=1 for each impl (needs the megatron wheel)
#   inference  swiglu-train bench-inference: gated projection and whole MLP, Qwen-2.5 x M grid
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD WANDB_MODE=offline WANDB_SILENT=true
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
for stage in "$@"; do
  echo "== $stage"
  case $stage in
    setup)
      [ -d .whlx ] && bash scripts/device_setup.sh
      [ -d .whlw ] && python3 -m pip install -q --no-index --no-deps --no-compile .whlw/*.whl ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    tune)
      python3 scripts/tune_gated_gemm.py --samples 30 --json "$OUT/tune_gated_h200.json" \
        2>&1 | grep -v "^ " ;;
    bench)
      python3 scripts/bench_mlp.py --samples 40 --commit "$commit" --json "$OUT/mlp_h200.json" \
        2>&1 | tail -30 ;;
    stack)
      python3 -m swiglu_train bench-memory --layers 1,2,4 --mlp-impl normal,drop_h,save_factors \
        --overhead-samples 30 --json "$OUT/stack_h200.json" 2>&1 | tail -20 ;;
    crossover)
      python3 scripts/bench_crossover.py --commit "$commit" --json "$OUT/crossover_h200.json" \
        --table "$OUT/table/crossover_h200.json" 2>&1 | tail -40 ;;
    pretrain)
      for round in 1 2; do
        for impl in normal drop_h save_factors; do
          python3 -m swiglu_train pretrain --config 125m --mlp-impl "$impl" --max-steps 40 \
            --output-dir "/tmp/pt-$impl-$round" --summary-json "$OUT/pretrain_${impl}_$round.json" \
            > "/tmp/pt-$impl-$round.log" 2>&1 || tail -5 "/tmp/pt-$impl-$round.log"
        done
      done
      python3 - "$OUT" <<'PY'
import json, sys, glob
for path in sorted(glob.glob(f"{sys.argv[1]}/pretrain_*.json")):
    s = json.load(open(path))
    print(path.rsplit("/", 1)[-1], f"{s['tokens_per_s']:.0f} tok/s",
          f"after-fwd {s['after_forward_MiB']:.1f} MiB", f"peak {s['peak_MiB']:.1f} MiB")
PY
      ;;
    microbatch)
      python3 scripts/max_micro_batch.py --config 1b --mlp-impl normal,drop_h \
        --json "$OUT/max_micro_batch_1b.json" ;;
    megatron)
      for impl in stock normal drop_h save_factors; do
        torchrun --nproc-per-node 1 recipes/pretrain_megatron.py --mlp-impl "$impl" \
          --max-steps 25 --output-dir /tmp/megatron-runs \
          --summary-json "$OUT/megatron_tp1_$impl.json" 2>&1 | tail -2
      done ;;
    inference)
      python3 scripts/bench_inference.py --samples 30 --commit "$commit" \
        --json "$OUT/inference_h200.json" \
        --md "$OUT/inference_h200.md" 2>&1 | tail -60 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
