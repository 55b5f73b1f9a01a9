#!/usr/bin/env bash
# The GPU work of the open issues, in stages, for the device tool (each stage < 10 minutes):
#   bash scripts/gpu_session.sh STAGE [STAGE...]      results land in $OUT (default ./gpu-out)
# To run committed code while the working tree changes: `bash scripts/device_snapshot.sh` here,
# carry .src with the wheel folders, and `bash scripts/device_run.sh STAGE[:SECONDS]...` on the
# box (a fresh folder per call, setup included, results in $OUT/results-*.tgz after each stage).
# Stages:
#   setup      install carried wheels (.whl + .whlx: peers; .whlw: wandb, megatron-core;
#              .whlt: pytest-xdist; .whlm: megatron-core alone; .whlh: litgpt) when present
#   tests      the `gpu` tests (CUDA params and GPU-only tests; CI runs the rest)
#   quack_tiles scripts/probe_quack_tiles.py: quack's gated GEMM under each small-M config
#   tune       scripts/tune_gated_gemm.py: the gated GEMM's configs and its ratio to cuBLAS
#              (TUNE_SHAPES="M,K,F ..." picks the shapes)
#   sweep      scripts/sweep_gated_configs.py: every gated GEMM config at small-M inference
#              shapes, CUDA-graph timed ($SWEEP_SHAPES, $SWEEP_EXTRA_TILES: "BM,BN,BK,S,W,P ...")
#   bench      scripts/bench_mlp.py at the seed shape, every variant (save_factors included)
#   stack      swiglu-train bench-memory for every impl, with the profiler's overhead
#   crossover  swiglu-train bench-crossover on the default grid, and impl="auto"'s table
#   pretrain   125M Lightning runs, impls alternated twice (tokens/s, after-forward, peak)
#   microbatch the largest micro-batch at ~1B: normal, drop_h, drop_h+fp8 and the quack impls
#   megatron   recipes/pretrain_megatron.py at TP=1 for each impl (needs the megatron wheel)
#   e2e_1b / e2e_3b  scripts/bench_e2e.py lightning: ~1B (configs/1b.yaml) / ~3B (3b.yaml) at
#              seq 4096, every impl (quack's and drop_h+fp8 included) x checkpointed blocks
#              ($E2E_GRID_1B/3B), $E2E_ROUNDS rounds interleaved (default 3), the planner at 4
#              budgets between the grid's peaks; micro-batch $E2E_MBS_1B (4) / $E2E_MBS_3B (2),
#              global batch $E2E_GBS (32 sequences: the optimizer once per global batch);
#              $E2E_IMPLS picks the impls (at 3B a point takes ~10 s: 15 points a round, ~150 s).
#              Rounds add up across calls of one commit (--append, kept in /tmp/gpu-e2e-COMMIT):
#              where 3 rounds overrun a call, E2E_ROUNDS=1 E2E_PLANNER=0 twice, then E2E_ROUNDS=1.
#              At 3B the planner alone (E2E_ROUNDS=0) takes ~6 min at 2 budgets with 5 impls (its
#              plans measured in every round): E2E_BUDGETS=auto:2 there (default auto:4).
#              The JSON is written after every point: a stage cut at its bound keeps its points
#   e2e_megatron  scripts/bench_e2e.py megatron: TP=1 stock (fused and eager bias-SwiGLU, and
#              Liger's Megatron SwiGLU where liger-kernel is installed) vs our
#              impls, $MEGATRON_GPU, 5 warm-up + 20 timed steps per run, $E2E_ROUNDS_MEGATRON
#              rounds per call (default 1: call it 3 times, rounds add up as above); the first
#              run of stock, stock_eager and normal ($E2E_PROFILE_MEGATRON) also profiles its last
#              timed step (kernel and host times; once). $E2E_MEGATRON_IMPLS picks the impls.
#              E2E_SAMPLE_HOST=1 (py-spy, carried in .whlw): every run sampled, the frames of
#              its steps in the JSON (host_samples) and its raw stacks in e2e/host_NAME/;
#              E2E_SAMPLE_NATIVE=1 as well: C and C++ frames too (py-spy --native)
#              E2E_PRIOR=DIR (carried): rounds of an earlier call, at another commit, to add to
#              (e2e_1b/e2e_3b too; E2E_ROUNDS=0 then measures only the planner and its plans)
#   megatron_plan  the recipe's own planner (--activation-checkpointing auto) at
#              $MEGATRON_PLAN_GB (30: under the MEGATRON_GPU model's ~39 GB unchecked peak)
#   megatron_resume  its DistributedOptimizer dist-ckpt: save at step 3, resume, compare losses
#   megatron_tp2  (nvidia-h200-x2) TP=2 vs TP=1 losses and per-GPU memory (scripts/compare_tp.py)
#   megatron_reshard (nvidia-h200-x2) a save_factors TP=2 dist-ckpt resumed by normal at TP=1,
#              and a drop_h TP=1 one resumed by save_factors at TP=2
#   lightning_ddp (nvidia-h200-x2) the 125M pretrain under DDP on 2 GPUs
#   step_gap   scripts/probe_step_gap.py: queued vs idle timing, kernels, host time per variant
#   fuzz       scripts/fuzz_gpu.py, 1000 cases on 8 workers ($FUZZ_CASES, $FUZZ_SECONDS)
#   cublas_k   scripts/probe_cublas_k_tail.py: cuBLAS's accuracy around K = 16n + r
#   gemm_defaults scripts/probe_gemm_defaults.py: quack (static, dynamic) vs cuBLAS per GEMM
#              choice at the grid's shapes ($GRID_M picks the M), the evidence for the defaults
#   fp8_errors scripts/measure_fp8_saved.py on CUDA at the grid's (D, F), M = $FP8_ERRORS_M
#   patch      scripts/bench_patch_hf.py for HF and LitGPT (carry litgpt and jsonargparse)
#   fp8_chunks scripts/probe_fp8_chunks.py: FP8-saved drop_h's row chunks vs drop_h
#   fp8_loss_ab  (issue 19) 125M pretrain, drop_h bf16 vs --saved-fp8 at seeds 1 and 2 (init and
#              data order), $FP8_AB_STEPS steps (1000) at the config's micro-batch of 8 x 2048
#              tokens ($FP8_AB_MBS), then scripts/plot_loss_ab.py: final losses (mean of the last
#              100 steps) against bf16's seed spread, and the curves. 217k tokens/s
#              (pretrain_125m_h200.json, drop_h) is 75 s per 1000 steps, ~25 s more per run for
#              start-up, one validation and one checkpoint: ~7 min for the four. A run done is
#              skipped (kept in /tmp/gpu-fp8ab-COMMIT), so a call cut short is finished by the next
#   scale4     (nvidia-h200-x4) Megatron at TP=1, TP=4 and TP=2xDP=2 from one init (--cpu-init),
#              one global batch, 50 steps ($SCALE4_MODEL; $SCALE4_IMPLS, $SCALE4_LAYOUTS pick a
#              subset): loss curves, tokens/s, per-GPU memory (scripts/compare_tp.py). Runs add
#              up across calls of one commit (kept in /tmp/gpu-scale4-COMMIT, done ones skipped)
#   scale4_rounds (nvidia-h200-x4) tokens/s rounds $SCALE4_ROUNDS (default "2 3") of the same
#              runs (20 steps, 5 warm-up, impl order rotated); summarize_runs.py per layout
#   scale4_reshard (nvidia-h200-x4) a save_factors TP=4 dist-ckpt resumed by normal and stock at
#              TP=1 and by drop_h at TP=2 ($MEGATRON_GPU)
#   scale4_lightning (nvidia-h200-x4) pretrain 125M on 4 GPUs (--strategy fsdp2: fully_shard per
#              block) against 1 GPU at the same global batch, each impl, and the planner's choice
#              at 1B
#   inference  swiglu-train bench-inference: gated projection and whole MLP, Qwen-2.5 x M grid
#              ($INFERENCE_MODELS), one JSON per model to merge into the dispatch table
#   grid       swiglu-train bench-grid: every impl and peer, and auto's pick, at public models'
#              MLP shapes x M; one chunk per call ($GRID_CHUNK=I/N, default 1/1; $GRID_MODELS,
#              $GRID_M and $GRID_VARIANTS pick a subset; $GRID_SHAPES "DxF,..." shapes no model lists,
#              $GRID_TAG prefixes the files' chunk tag), its points compiled first in $GRID_PREWARM processes
#              (default 8; 0: compile while timing). Merge the chunks' JSON with
#              `swiglu-train bench-grid --merge A B --json --md --plot` (the auto evaluation).
# Every stage writes under $RES; on exit it is packed into $OUT/results-*.tgz, since the device
# tool returns at most 8 files, and re-packed after every stage, so a call killed at its limit
# still returns what finished. STAGE_SECONDS=N bounds each stage, so one overrun cannot cost
# the others (a session found this out when a stage ate the call's whole limit); a stage
# written STAGE:N gets its own bound of N seconds.
set -uo pipefail
OUT=${OUT:-./gpu-out}
# A fresh folder per call: a lent machine may keep /tmp from an earlier session, whose results
# would otherwise ride along in the archive looking current.
RES=${RES:-$(mktemp -d /tmp/gpu-results.XXXXXX)}
# Run folders too: pretrain refuses a fresh run where another run's checkpoints are, and a
# stale folder's W&B runs would be counted as this call's.
SCRATCH=${SCRATCH:-$(mktemp -d /tmp/gpu-scratch.XXXXXX)}
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD WANDB_MODE=offline WANDB_SILENT=true OUT RES SCRATCH
# A step of the recipe's CPU-sized default model is launch-bound on an H200 (30 ms): time a
# model whose GEMMs dominate instead.
MEGATRON_GPU="--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 8"
# A model where TP matters (issue 24). Selective recompute drops the local spec's unfused
# attention scores ([heads, s, s] per layer, 1 GiB at s = 4096), which would crowd TP=1 out of the
# H200; the MLPs' saved tensors, the subject, are untouched by it.
SCALE4_MODEL=${SCALE4_MODEL:-"--num-layers 16 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --recompute-granularity selective"}
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export SWIGLU_TRAIN_COMMIT=$commit  # results name it, not the box's own (stale) checkout's HEAD
# The quack impls join the training stages where they run (quack installed, sm_90+). Its wheels
# (.whl + .whlx) and .whlw do not fit one carry; a machine keeps what `setup` installed while it
# stays warm (30 s after a call), so run setup with .whl + .whlx, then straight away carry .whlw.
fp8_quack_impl() {  # drop_h_quack with its preactivation saved in FP8, where quack runs
  [ -n "$(quack_impl)" ] && echo drop_h_quack+fp8
  return 0
}
quack_impl() {  # asked per stage: `setup` may have installed quack earlier in the same call
  python3 -c "
from swiglu_train.layers.registry import QUACK_IMPLS
from swiglu_train.ops.quack_mlp import quack_available
print(*sorted(QUACK_IMPLS) if quack_available() else [])"
}
# One archive per results folder: two invocations in one device call must not overwrite each
# other's (a session lost a Megatron round's JSON so).
# An e2e stage cut at its bound has its points only in /tmp/gpu-e2e-COMMIT (written after each
# point): bring the latest of those back too.
pack() {
  if ls "/tmp/gpu-e2e-$commit"/e2e_*.json > /dev/null 2>&1; then
    mkdir -p "$RES/e2e" && cp "/tmp/gpu-e2e-$commit"/e2e_*.json "$RES/e2e/"
  fi
  tar czf "$OUT/results-${RES##*.}.tgz" -C "$RES" .
}
prior_e2e() {  # DIR NAME: an earlier call's rounds ($E2E_PRIOR/NAME, carried) to --append to,
  # where this commit has none of its own yet (a machine's /tmp goes when it is given back)
  [ -n "${E2E_PRIOR:-}" ] && [ -f "$E2E_PRIOR/$2" ] && [ ! -f "$1/$2" ] && cp "$E2E_PRIOR/$2" "$1/"
  return 0
}
scale4_run() {  # IMPL LAYOUT ARGS...: the recipe at tp1 (1 GPU), tp4 or tp2dp2 (4 GPUs), every
  # layout at a global batch of 2 sequences (micro-batch 1 x micro-batches x DP)
  local impl=$1 layout=$2 n par
  shift 2
  case $layout in
    tp1) n=1 par="--tp 1 --num-microbatches 2" ;;
    tp4) n=4 par="--tp 4 --num-microbatches 2" ;;
    tp2dp2) n=4 par="--tp 2 --dp 2 --num-microbatches 1" ;;
    *) echo "unknown layout $layout"; return 2 ;;
  esac
  torchrun --nproc-per-node "$n" recipes/pretrain_megatron.py --mlp-impl "$impl" $par \
    $SCALE4_MODEL --output-dir "$SCRATCH/megatron-scale4" "$@"
}
compare_losses() {  # FULL.log RESUMED.log LABEL: the resumed steps' losses against the full run's,
  # printed and appended to $RES/resume_checks.jsonl
  python3 - "$@" <<'PY'
import json, os, re, sys
def losses(path):
    return {int(s): float(l) for s, l in re.findall(r"^step (\d+) loss ([\d.]+)", open(path).read(), re.M)}
full, resumed = losses(sys.argv[1]), losses(sys.argv[2])
rel = {s: abs(resumed[s] - full[s]) / full[s] for s in sorted(resumed) if s in full}
print(sys.argv[3], "resumed steps", sorted(resumed), "rel diff per step", {s: f"{d:.2e}" for s, d in rel.items()})
check = {"label": sys.argv[3], "full": full, "resumed": resumed, "rel_diff": rel}
with open(os.path.join(os.environ["RES"], "resume_checks.jsonl"), "a") as f:
    f.write(json.dumps(check) + "\n")
PY
}
if [ -n "${STAGE_SECONDS:-}" ]; then  # each stage in its own bounded run of this script
  export IN_SESSION=1
  trap pack EXIT
  for spec in "$@"; do
    stage=${spec%%:*} seconds=$STAGE_SECONDS
    [ "$stage" != "$spec" ] && seconds=${spec#*:}
    STAGE_SECONDS= timeout "$seconds" bash "$0" "$stage" || echo "== $stage: exit $?"
    pack
  done
  exit 0
fi
[ -z "${IN_SESSION:-}" ] && export IN_SESSION=1 && trap pack EXIT
for stage in "$@"; do
  echo "== $stage"
  case $stage in
    setup)  # quack's wheels once per machine: a warm machine keeps them (unpacking takes ~30 s)
      if [ -d .whlx ] && ! python3 -c "import quack, liger_kernel" 2>/dev/null; then
        bash scripts/device_setup.sh
      fi
      for d in .whlw .whlt .whlm .whlh; do  # whichever this call carried
        if [ -d $d ]; then python3 -m pip install -q --no-index --no-deps --no-compile $d/*.whl; fi
      done ;;
    tests)  # in parallel where pytest-xdist is carried (.whlt): Triton compiles are CPU-bound.
      # -v: a call cut at its limit still shows each test's outcome. The gpu_alone tests time
      # the GPU and run after the rest, alone. pretrain's tests log to W&B: they skip unless
      # .whlw was installed too (it does not fit the quack carry).
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12" || true)
      python3 -m pytest -v -rfE -m "gpu and not gpu_alone" -p no:cacheprovider $workers \
        --durations=12 > "$RES/pytest.log" 2>&1
      python3 -m pytest -v -rfE -m "gpu and gpu_alone" -p no:cacheprovider >> "$RES/pytest.log" 2>&1
      grep -E "(FAILED|ERROR) |passed|failed" "$RES/pytest.log" | tail -25 ;;
    quack_tiles)  # the wave-fill rule's choice against every quack config, M <= 512
      python3 scripts/probe_quack_tiles.py --samples 30 --commit "$commit" \
        --models "${QUACK_TILE_MODELS:-0.5b,7b,32b,72b}" --extra-tiles "${QUACK_EXTRA_TILES:-}" \
        --json "$RES/probe_quack_tiles_h200.json" --md "$RES/probe_quack_tiles_h200.md" ;;
    tune)
      python3 scripts/tune_gated_gemm.py --samples 30 --json "$RES/tune_gated_h200.json" \
        ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} \
        2>&1 | grep -v "^ " ;;
    sweep)
      python3 scripts/sweep_gated_configs.py --samples 30 --commit "$commit" \
        ${SWEEP_SHAPES:+--shapes $SWEEP_SHAPES} ${SWEEP_EXTRA_TILES:+--extra-tiles $SWEEP_EXTRA_TILES} \
        --json "$RES/sweep_gated_h200.json" --md "$RES/sweep_gated_h200.md" \
        --table "$RES/gated_tiles_h200.json" ;;
    bench)
      python3 scripts/bench_mlp.py --samples 40 --commit "$commit" --json "$RES/mlp_h200.json" \
        2>&1 | tail -30 ;;
    stack)
      python3 -m swiglu_train bench-memory --layers 1,2,4 --mlp-impl normal,drop_h,save_factors \
        --overhead-samples 30 --json "$RES/stack_h200.json" 2>&1 | tail -20 ;;
    crossover)
      python3 scripts/bench_crossover.py --commit "$commit" --json "$RES/crossover_h200.json" \
        --auto-model "$RES/auto_h200.json" 2>&1 | tail -40 ;;
    pretrain)
      for round in $(seq "${PRETRAIN_ROUNDS:-2}"); do  # 125M tokens/s moves ±5 % run to run
        for impl in normal drop_h save_factors $(quack_impl); do
          python3 -m swiglu_train pretrain --config 125m --mlp-impl "$impl" --max-steps 40 \
            --output-dir "$SCRATCH/pt-$impl-$round" --summary-json "$RES/pretrain_${impl}_$round.json" \
            > "$SCRATCH/pt-$impl-$round.log" 2>&1 || tail -5 "$SCRATCH/pt-$impl-$round.log"
        done
      done
      python3 scripts/summarize_runs.py "$RES"/pretrain_*_[0-9]*.json --commit "$commit" \
        --title "125M Lightning pretrain, bf16, 40 steps (impls alternated, ${PRETRAIN_ROUNDS:-2} rounds)" \
        --command "bash scripts/gpu_session.sh pretrain" \
        --json "$RES/pretrain_125m_h200.json" --md "$RES/pretrain_125m_h200.md" \
        && cat "$RES/pretrain_125m_h200.md" ;;
    microbatch)  # per config in MICROBATCH_CONFIGS; FP8-saved drop_h_quack where quack runs
      impls=$(echo normal drop_h drop_h+fp8 $(quack_impl) $(fp8_quack_impl) | tr ' ' ',')
      for config in ${MICROBATCH_CONFIGS:-1b}; do
        python3 scripts/max_micro_batch.py --config "$config" --mlp-impl "$impls" \
          --commit "$commit" --json "$RES/max_micro_batch_$config.json"
      done ;;
    fp8_lightning)  # issue 19: after-forward and peak of the Lightning models, FP8-saved or not
      for config in ${FP8_LIGHTNING_CONFIGS:-125m 1b}; do
        quack_pair=$([ -n "$(fp8_quack_impl)" ] && echo drop_h_quack drop_h_quack+fp8)
        for impl in normal drop_h drop_h+fp8 $quack_pair; do
          fp8=$([ "${impl%+fp8}" != "$impl" ] && echo --saved-fp8 || echo --no-saved-fp8)
          run="fp8mem_${config}_${impl/+/_}"
          python3 -m swiglu_train pretrain --config "$config" --mlp-impl "${impl%+fp8}" $fp8 \
            --max-steps "${FP8_LIGHTNING_STEPS:-20}" --output-dir "$SCRATCH/$run" \
            --summary-json "$RES/${run}_1.json" > "$SCRATCH/$run.log" 2>&1 \
            || tail -5 "$SCRATCH/$run.log"
          rm -rf "$SCRATCH/$run/checkpoints"
        done
        python3 scripts/summarize_runs.py "$RES"/fp8mem_${config}_*_1.json --commit "$commit" \
          --title "$config Lightning pretrain, bf16-mixed, ${FP8_LIGHTNING_STEPS:-20} steps: FP8-saved preactivation against bf16" \
          --command "bash scripts/gpu_session.sh fp8_lightning" \
          --json "$RES/fp8_lightning_${config}_h200.json" --md "$RES/fp8_lightning_${config}_h200.md" \
          && cat "$RES/fp8_lightning_${config}_h200.md"
      done ;;
    megatron)  # two rounds, the order reversed in the second, so no impl always runs first
      order="stock stock_eager normal drop_h save_factors $(quack_impl)"
      for round in 1 2; do
        for impl in $order; do
          torchrun --nproc-per-node 1 recipes/pretrain_megatron.py --mlp-impl "$impl" \
            $MEGATRON_GPU --max-steps 30 --output-dir $SCRATCH/megatron-runs \
            --summary-json "$RES/megatron_tp1_${impl}_$round.json" 2>&1 | tail -1
        done
        order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
      done
      python3 scripts/summarize_runs.py "$RES"/megatron_tp1_*_[12].json --commit "$commit" \
        --title "Megatron recipe, TP=1, bf16 Float16Module + DistributedOptimizer, 30 steps, $MEGATRON_GPU (2 rounds, order reversed)" \
        --command "bash scripts/gpu_session.sh megatron" \
        --json "$RES/megatron_h200_tp1.json" --md "$RES/megatron_h200_tp1.md" \
        && cat "$RES/megatron_h200_tp1.md" ;;
    e2e_1b|e2e_3b)  # whole training steps, impl x checkpointed blocks, planner at 4 budgets
      size=${stage#e2e_} && E2E=/tmp/gpu-e2e-$commit && mkdir -p "$E2E" "$RES/e2e"
      prior_e2e "$E2E" "e2e_${size}_h200.json"
      # coarse grids: the planner's plans between their counts (every impl's) are measured too
      if [ "$size" = 1b ]; then grid=${E2E_GRID_1B:-0,4,8,12,16} mbs=${E2E_MBS_1B:-4}
      else grid=${E2E_GRID_3B:-0,7,14,21,28} mbs=${E2E_MBS_3B:-2}; fi
      impls=${E2E_IMPLS:-$(echo normal drop_h $(quack_impl) drop_h+fp8 | tr ' ' ',')}
      python3 scripts/bench_e2e.py lightning --config "$size" --seq-length 4096 \
        --micro-batch-size "$mbs" --global-batch-size "${E2E_GBS:-32}" --impls "$impls" \
        --checkpoint-layers "$grid" \
        --rounds "${E2E_ROUNDS:-3}" --budgets-gb "${E2E_BUDGETS:-auto:4}" $([ "${E2E_PLANNER:-1}" = 1 ] && echo --planner) \
        --commit "$commit" --append \
        --json "$E2E/e2e_${size}_h200.json" --md "$E2E/e2e_${size}_h200.md" \
        --plot "$E2E/e2e_${size}_h200.png" 2>&1 | grep -v "^planner:" | tail -40
      cp "$E2E"/e2e_${size}_h200.* "$RES/e2e/" ;;
    e2e_megatron)  # stock vs ours at TP=1, interleaved; warm-up steps kept apart
      # $E2E_MEGATRON_ARGS (e.g. --manual-gc) go to every run; $E2E_MEGATRON_TAG names its files
      E2E=/tmp/gpu-e2e-$commit && mkdir -p "$E2E" "$RES/e2e" && name=e2e_megatron_tp1${E2E_MEGATRON_TAG:+_$E2E_MEGATRON_TAG}_h200
      prior_e2e "$E2E" $name.json
      liger=$(python3 -c "import liger_kernel.megatron" 2>/dev/null && echo liger)  # the peer
      # the box's busiest processes over each 10 s: host contention would show (stock's slow
      # runs); top's first frame counts since boot, the later ones each interval
      top -b -d 10 -o %CPU -w 160 2>&1 | awk '/^top -/ {n = 0} n++ < 16 {print; fflush()}' > "$RES/e2e/$name.top.log" &
      watcher=$!
      impls=${E2E_MEGATRON_IMPLS:-$(echo stock stock_eager $liger normal drop_h save_factors $(quack_impl) | tr ' ' ',')}
      # where a steady step's time goes: the first run of each of these also profiles its last
      # timed step (kernels and the host's side), kept across calls of a commit
      python3 scripts/bench_e2e.py megatron --impls "$impls" --rounds "${E2E_ROUNDS_MEGATRON:-1}" \
        --warmup 5 --steps 20 --commit "$commit" --append \
        --profile-impls "${E2E_PROFILE_MEGATRON-stock,stock_eager,normal}" --profile-dir "$E2E" \
        ${E2E_SAMPLE_HOST:+--sample-host "$E2E/host_$name"} ${E2E_SAMPLE_NATIVE:+--sample-native} \
        --json "$E2E/$name.json" --md "$E2E/$name.md" \
        -- $MEGATRON_GPU ${E2E_MEGATRON_ARGS:-} 2>&1 | tail -20
      kill $watcher 2>/dev/null
      cp "$E2E"/$name.* "$RES/e2e/"
      [ -d "$E2E/host_$name" ] && cp -r "$E2E/host_$name" "$RES/e2e/"
      for prof in "$E2E"/profile_megatron_*.json; do
        [ -f "$prof" ] || continue
        impl=$(basename "$prof" .json) && impl=${impl#profile_megatron_}
        cp "$prof" "$RES/e2e/profile_megatron_tp1_${impl}_h200.json"
        python3 -c "import json, sys; p = json.load(open(sys.argv[1])); print(sys.argv[2], round(p['step_s'] * 1e3, 1), 'ms step,', round(p['total_us'] / 1e3, 1), 'ms of kernels; host:', [(e['name'][:40], round(e['us']), e['count']) for e in p['host']['entries'][:10]])" "$prof" "$impl"
      done ;;
    megatron_plan)  # --activation-checkpointing auto in the recipe, at a budget under its peak
      torchrun --standalone --nproc-per-node 1 recipes/pretrain_megatron.py $MEGATRON_GPU \
        --activation-checkpointing auto --memory-budget-gb "${MEGATRON_PLAN_GB:-30}" \
        --max-steps 10 --output-dir "$SCRATCH/megatron-plan" \
        --summary-json "$RES/megatron_plan_h200.json" 2>&1 | grep -E "^plan:|^step 9 " ;;
    megatron_resume)  # DistributedOptimizer dist-ckpt on CUDA: save at 3, resume, same losses
      for impl in ${RESUME_IMPLS:-normal save_factors}; do
        run="torchrun --nproc-per-node 1 recipes/pretrain_megatron.py --mlp-impl $impl"
        run="$run --max-steps 6 --output-dir $SCRATCH/megatron-runs"
        $run --save "$SCRATCH/mck-$impl" --save-interval 3 > "$RES/resume_full_$impl.log" 2>&1
        $run --load "$SCRATCH/mck-$impl/iter_0000003" > "$RES/resume_from3_$impl.log" 2>&1
        compare_losses "$RES/resume_full_$impl.log" "$RES/resume_from3_$impl.log" "$impl"
      done ;;
    megatron_tp2)  # nvidia-h200-x2: TP=2 against TP=1 on the same data; dist-ckpt TP2 -> TP1
      mkdir -p "$RES/tp"
      for impl in normal drop_h save_factors; do
        for tp in 1 2; do
          torchrun --nproc-per-node "$tp" recipes/pretrain_megatron.py --mlp-impl "$impl" \
            --tp "$tp" --cpu-init $MEGATRON_GPU --max-steps 50 --output-dir $SCRATCH/megatron-tp \
            --summary-json "$RES/tp/megatron_tp${tp}_$impl.json" 2>&1 | tail -1
        done
      done
      python3 scripts/compare_tp.py "$RES"/tp/*.json --commit "$commit" \
        --title "Megatron TP=2 against TP=1, bf16, 50 steps, $MEGATRON_GPU" \
        --command "bash scripts/gpu_session.sh megatron_tp2" \
        --json "$RES/megatron_tp2_vs_tp1_h200.json" --md "$RES/megatron_tp2_vs_tp1_h200.md" \
        --plot "$RES/megatron_tp2_vs_tp1_h200.png" ;;
    megatron_reshard)  # nvidia-h200-x2: a packed checkpoint written at TP=2 resumes a canonical
      # model at TP=1 (and back: a canonical TP=1 checkpoint resumes save_factors at TP=2)
      run="recipes/pretrain_megatron.py --max-steps 6 --output-dir $SCRATCH/megatron-runs"
      torchrun --nproc-per-node 2 $run --tp 2 --mlp-impl save_factors --save $SCRATCH/mck-tp2 \
        --save-interval 3 > "$RES/reshard_tp2_full.log" 2>&1
      torchrun --nproc-per-node 1 $run --tp 1 --mlp-impl normal \
        --load $SCRATCH/mck-tp2/iter_0000003 > "$RES/reshard_tp1_from3.log" 2>&1
      compare_losses "$RES/reshard_tp2_full.log" "$RES/reshard_tp1_from3.log" \
        "save_factors TP2 -> normal TP1"
      torchrun --nproc-per-node 1 $run --tp 1 --mlp-impl drop_h --save $SCRATCH/mck-tp1 \
        --save-interval 3 > "$RES/reshard_tp1_full.log" 2>&1
      torchrun --nproc-per-node 2 $run --tp 2 --mlp-impl save_factors \
        --load $SCRATCH/mck-tp1/iter_0000003 > "$RES/reshard_tp2_from3.log" 2>&1
      compare_losses "$RES/reshard_tp1_full.log" "$RES/reshard_tp2_from3.log" \
        "drop_h TP1 -> save_factors TP2" ;;
    lightning_ddp)  # nvidia-h200-x2: DDP with the memory callback; one W&B run, one summary
      python3 -m swiglu_train pretrain --config 125m --mlp-impl drop_h --devices 2 \
        --strategy ddp --max-steps 40 --output-dir $SCRATCH/pt-ddp \
        --summary-json "$RES/pretrain_ddp_drop_h.json" > "$RES/pretrain_ddp.log" 2>&1 \
        || tail -5 "$RES/pretrain_ddp.log"
      echo "W&B offline runs: $(ls -d $SCRATCH/pt-ddp/wandb/offline-run-* | wc -l)" ;;
    scale4)  # nvidia-h200-x4: round 1, the loss curves and memory; a run done is skipped
      S4=/tmp/gpu-scale4-$commit && mkdir -p "$S4" "$RES/scale4"
      for impl in ${SCALE4_IMPLS:-stock normal drop_h $(quack_impl)}; do
        for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do
          json="$S4/megatron_${layout}_${impl}_1.json"
          [ -f "$json" ] && continue
          scale4_run "$impl" "$layout" --cpu-init --max-steps 50 --summary-json "$json" \
            > "$S4/megatron_${layout}_${impl}_1.log" 2>&1 || tail -5 "$S4/megatron_${layout}_${impl}_1.log"
          tail -1 "$S4/megatron_${layout}_${impl}_1.log"
        done
      done
      cp "$S4"/*.json "$RES/scale4/" 2>/dev/null
      python3 scripts/compare_tp.py "$S4"/megatron_*_1.json --commit "$commit" \
        --title "Megatron TP=4 and TP=2xDP=2 against TP=1, bf16, 50 steps, $SCALE4_MODEL" \
        --command "bash scripts/gpu_session.sh scale4" \
        --json "$RES/scale4/megatron_layouts_h200.json" --md "$RES/scale4/megatron_layouts_h200.md" \
        --plot "$RES/scale4/megatron_layouts_h200.png" ;;
    scale4_rounds)  # nvidia-h200-x4: tokens/s rounds; weights need not match here (no --cpu-init)
      S4=/tmp/gpu-scale4-$commit && mkdir -p "$S4" "$RES/scale4"
      order="${SCALE4_IMPLS:-stock normal drop_h $(quack_impl)}"
      for round in ${SCALE4_ROUNDS:-2 3}; do
        order=$(echo $order | awk '{for (i = 2; i <= NF; i++) printf "%s ", $i; print $1}')
        for impl in $order; do
          for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do
            json="$S4/megatron_${layout}_${impl}_$round.json"
            [ -f "$json" ] && continue
            scale4_run "$impl" "$layout" --max-steps 20 --warmup-steps 5 --summary-json "$json" \
              2>&1 | tail -1
          done
        done
      done
      cp "$S4"/*.json "$RES/scale4/" 2>/dev/null
      for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do
        python3 scripts/summarize_runs.py "$S4"/megatron_${layout}_*_[0-9]*.json --commit "$commit" \
          --title "Megatron $layout, bf16, tokens/s over rounds, $SCALE4_MODEL" \
          --command "bash scripts/gpu_session.sh scale4 scale4_rounds" \
          --json "$RES/scale4/megatron_${layout}_rounds_h200.json" \
          --md "$RES/scale4/megatron_${layout}_rounds_h200.md" && cat "$RES/scale4/megatron_${layout}_rounds_h200.md"
      done ;;
    scale4_reshard)  # nvidia-h200-x4: packed TP=4 dist-ckpt -> canonical TP=1 and TP=2
      mkdir -p "$RES/scale4"
      run="recipes/pretrain_megatron.py --max-steps 6 --output-dir $SCRATCH/megatron-runs $MEGATRON_GPU"
      torchrun --nproc-per-node 4 $run --tp 4 --mlp-impl save_factors --save $SCRATCH/mck-tp4 \
        --save-interval 3 > "$RES/scale4/reshard_tp4_full.log" 2>&1
      for target in normal:1 stock:1 drop_h:2; do
        impl=${target%:*} tp=${target#*:}
        torchrun --nproc-per-node "$tp" $run --tp "$tp" --mlp-impl "$impl" \
          --load $SCRATCH/mck-tp4/iter_0000003 > "$RES/scale4/reshard_${impl}_tp${tp}_from3.log" 2>&1
        compare_losses "$RES/scale4/reshard_tp4_full.log" "$RES/scale4/reshard_${impl}_tp${tp}_from3.log" \
          "save_factors TP4 -> $impl TP$tp"
      done ;;
    scale4_lightning)  # nvidia-h200-x4: 4 GPUs x micro-batch 8 against 1 GPU x 32 (same rows)
      mkdir -p "$RES/scale4"
      for impl in ${SCALE4_LIGHTNING_IMPLS:-normal drop_h save_factors $(quack_impl)}; do
        for gpus in 4 1; do
          if [ "$gpus" = 4 ]; then extra="--strategy fsdp2"; else extra="--micro-batch-size 32"; fi
          python3 -m swiglu_train pretrain --config 125m --mlp-impl "$impl" --devices "$gpus" \
            $extra --max-steps 40 --output-dir "$SCRATCH/pt${gpus}-$impl" \
            --summary-json "$RES/scale4/lightning_${gpus}gpu_$impl.json" \
            > "$RES/scale4/lightning_${gpus}gpu_$impl.log" 2>&1 || tail -5 "$RES/scale4/lightning_${gpus}gpu_$impl.log"
        done
        echo "$impl W&B offline runs (4 GPUs): $(ls -d $SCRATCH/pt4-$impl/wandb/offline-run-* | wc -l)"
      done
      # the planner measures one device: plan on 1 GPU, then run its choice on 4 under fsdp2
      python3 -m swiglu_train pretrain --config 1b --activation-checkpointing auto --devices 1 \
        --max-steps 20 --output-dir "$SCRATCH/pt1-plan" \
        --summary-json "$RES/scale4/lightning_1gpu_planner.json" > "$RES/scale4/lightning_1gpu_planner.log" 2>&1 \
        || tail -5 "$RES/scale4/lightning_1gpu_planner.log"
      read -r plan_impl plan_layers < <(python3 -c "import json, sys; p = json.load(open(sys.argv[1]))['plan']; print(p['impl'], p['checkpoint_layers'])" "$RES/scale4/lightning_1gpu_planner.json")
      python3 -m swiglu_train pretrain --config 1b --mlp-impl "$plan_impl" --checkpoint-layers "$plan_layers" \
        --devices 4 --strategy fsdp2 --max-steps 20 --output-dir "$SCRATCH/pt4-plan" \
        --summary-json "$RES/scale4/lightning_4gpu_planned.json" > "$RES/scale4/lightning_4gpu_planned.log" 2>&1 \
        || tail -5 "$RES/scale4/lightning_4gpu_planned.log"
      python3 - "$RES/scale4" <<'PY'
import json, pathlib, statistics, sys
from swiglu_train.files import write_json_atomic
root = pathlib.Path(sys.argv[1])
out = {}
for four in sorted(root.glob("lightning_4gpu_*.json")):
    one = four.with_name(four.name.replace("4gpu", "1gpu"))
    if not one.exists():
        continue
    a, b = json.loads(four.read_text()), json.loads(one.read_text())
    steps = sorted(set(a["losses"]) & set(b["losses"]), key=int)
    if not steps:
        continue
    diffs = [abs(a["losses"][s] - b["losses"][s]) for s in steps]
    out[a["mlp_impl"]] = {
        "steps": len(steps), "step0_abs_loss_diff": diffs[0], "max_abs_loss_diff": max(diffs),
        "median_abs_loss_diff": statistics.median(diffs),
        **{f"{k}_{n}gpu": r[k] for n, r in ((4, a), (1, b)) for k in ("tokens_per_s", "after_forward_MiB", "peak_MiB")},
    }
    print(a["mlp_impl"], out[a["mlp_impl"]])
write_json_atomic(root / "lightning_4gpu_vs_1gpu_h200.json", out)
PY
      ;;
    inference)  # one run per model, so a stage cut short keeps the models it finished; merge
      # with `swiglu-train bench-inference --merge ... --json --md --dispatch-table`
      mkdir -p "$RES/inference"
      for model in ${INFERENCE_MODELS:-0.5b 7b 32b 72b}; do
        python3 scripts/bench_inference.py --models "$model" --samples 30 --commit "$commit" \
          --json "$RES/inference/$model.json" --md "$RES/inference/$model.md" 2>&1 | tail -40
      done ;;
    step_gap)  # where a step's time over the floor goes: queued vs idle, kernels, host time
      python3 scripts/probe_step_gap.py --shapes ${STEP_GAP_SHAPES:-4096,4096,11008 8192,4096,14336 4096,896,4864} \
        --samples 30 --out "$RES/probe_step_gap_h200.json" 2>&1 | grep "queued\|fresh\|\[" | cut -c1-160 ;;
    fuzz)  # >= 1000 random cases of every impl against float64, 8 worker processes
      python3 scripts/fuzz_gpu.py --cases "${FUZZ_CASES:-1000}" --workers 8 \
        --max-seconds "${FUZZ_SECONDS:-420}" --json "$RES/fuzz_gpu_h200.json" 2>&1 | tail -8 ;;
    fp8_errors)  # issue 19: bf16 vs FP8-saved drop_h against float64 at the grid's (D, F)
      python3 scripts/measure_fp8_saved.py --device cuda --grid-m "${FP8_ERRORS_M:-8000}" \
        --json "$RES/fp8_saved_errors_grid_h200.json" 2>&1 | tail -12 ;;
    gemm_defaults)  # quack vs cuBLAS on every gemm_choice GEMM at the grid's shapes (issue 18)
      python3 scripts/probe_gemm_defaults.py ${GRID_M:+--m ${GRID_M//,/ }} \
        --json "$RES/probe_gemm_defaults_h200.json" 2>&1 | tail -8 ;;
    cublas_k)  # where torch's cuBLAS GEMM loses accuracy at a K tail (the fuzz's finding)
      python3 scripts/probe_cublas_k_tail.py --out "$RES/probe_cublas_k_tail_h200.json" \
        | grep "over" | head -40 ;;
    patch)  # issue 20: a patched HF and LitGPT Llama against unpatched (and Liger, HF)
      for lib in hf litgpt; do
        python3 scripts/bench_patch_hf.py --library $lib --layers 4 --seq 4096 --samples 30 \
          --out "$RES/patch_${lib}_h200.json" 2>&1 | tail -12
      done ;;
    fp8_chunks)  # issue 19: the FP8-saved drop_h's chunks against drop_h and the floor, at
      # the seed shape and at Llama-3-8B's with M = 8000, each variant's kernels listed
      python3 scripts/probe_fp8_chunks.py --profile --rows 2816 11136 \
        --json "$RES/probe_fp8_chunks_h200.json" --md "$RES/probe_fp8_chunks_h200.md"
      python3 scripts/probe_fp8_chunks.py --profile --shape 8000 4096 14336 4096 --rows 8000 \
        --json "$RES/probe_fp8_chunks_8000_h200.json" --md "$RES/probe_fp8_chunks_8000_h200.md" ;;
    quack_fp8)  # issue 19: drop_h_quack with the FP8 copy (its quack epilogues), format and step
      # at the seed shape and Llama-3-8B's at M = 8000; then its gradients' errors on the grid
      python3 scripts/probe_quack_fp8.py --profile --samples 30 \
        --out "$RES/probe_quack_fp8_h200.json" --md "$RES/probe_quack_fp8_h200.md" | tail -14
      python3 scripts/measure_fp8_saved.py --device cuda --grid-m 8000 --impl drop_h_quack \
        --json "$RES/fp8_saved_errors_grid_quack_h200.json" | tail -4 ;;
    quack_fp8_oos)  # issue 19: the FP8-saved step at shapes no table or earlier probe used
      python3 scripts/probe_quack_fp8.py --step-only --samples 30 --shapes ${QUACK_FP8_OOS:-\
        12288,2304,9216 6144,5120,17920 12288,7168,18432 2048,3200,8640 16384,1536,8960} \
        --out "$RES/probe_quack_fp8_oos_h200.json" --md "$RES/probe_quack_fp8_oos_h200.md" \
        | tail -30 ;;
    fp8_loss_ab)  # issue 19 item 4: bf16 and FP8-saved drop_h from the same seeds, interleaved
      AB=/tmp/gpu-fp8ab-$commit && steps=${FP8_AB_STEPS:-1000} && mkdir -p "$AB" "$RES/fp8_loss_ab"
      for seed in 1 2; do
        python3 - "$seed" "$steps" "$AB/125m_seed$seed.yaml" <<'PY'
import sys, yaml
from swiglu_train.integrations.lightning.config import resolve_config_path
seed, steps, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = yaml.safe_load(resolve_config_path("125m").read_text())
cfg["data"]["seed"] = seed  # the run's seed draws the data order as well as the init
cfg["train"].update(seed=seed, max_steps=steps, val_check_interval=steps, checkpoint_every=steps)
open(path, "w").write(yaml.safe_dump(cfg))
PY
        for arm in bf16 fp8; do
          run="ab_${arm}_seed$seed" && [ -f "$AB/$run.json" ] && continue
          fp8=$([ "$arm" = fp8 ] && echo --saved-fp8 || echo --no-saved-fp8)
          python3 -m swiglu_train pretrain --config "$AB/125m_seed$seed.yaml" --mlp-impl drop_h \
            $fp8 ${FP8_AB_MBS:+--micro-batch-size $FP8_AB_MBS} --output-dir "$SCRATCH/$run" \
            --summary-json "$AB/$run.json" > "$AB/$run.log" 2>&1 || tail -5 "$AB/$run.log"
          rm -rf "$SCRATCH/$run/checkpoints"  # 1.5 GB a run, not needed
          python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print(sys.argv[2], {k: s[k] for k in ('final_loss', 'val_loss', 'tokens_per_s')})" "$AB/$run.json" "$run" 2>/dev/null
        done
      done
      cp "$AB"/ab_* "$RES/fp8_loss_ab/" 2>/dev/null
      if [ "$(ls "$AB"/ab_*_seed*.json 2>/dev/null | wc -l)" = 4 ]; then
        python3 scripts/plot_loss_ab.py "$AB"/ab_*_seed*.json --last 100 --smooth 50 --commit "$commit" \
          --title "125M Lightning pretrain, bf16-mixed, $steps steps: drop_h saving its preactivation in FP8 vs bf16, seeds 1 and 2" \
          --command "bash scripts/gpu_session.sh fp8_loss_ab" --json "$RES/fp8_loss_ab_125m_h200.json" \
          --md "$RES/fp8_loss_ab_125m_h200.md" --plot "$RES/fp8_loss_ab_125m_h200.png"
      else
        echo "fp8_loss_ab: $(ls "$AB"/ab_*_seed*.json 2>/dev/null | wc -l) of 4 runs done; call the stage again"
      fi ;;
    grid)  # the JSON is rewritten after every point: a chunk stopped at its bound keeps those
      chunk=${GRID_CHUNK:-1/1} && tag=${GRID_TAG:-}${chunk/\//of}
      PREWARM=${GRID_PREWARM:-8}  # workers that compile every point first: 16 cores, 1 GPU
      mkdir -p "$RES/grid"
      python3 -m swiglu_train bench-grid --commit "$commit" --chunk "$chunk" \
        --prewarm-workers "$PREWARM" \
        ${GRID_MODELS:+--models $GRID_MODELS} ${GRID_SHAPES:+--shapes $GRID_SHAPES} ${GRID_M:+--m $GRID_M} \
        ${GRID_VARIANTS:+--variants $GRID_VARIANTS} $([ "${GRID_PRETUNE:-0}" = 1 ] && echo --pretune) \
        --json "$RES/grid/grid_h200_$tag.json" --md "$RES/grid/grid_h200_$tag.md" \
        --plot "$RES/grid/grid_h200_$tag.png" 2>&1 | grep -v "^ " | tail -60 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
