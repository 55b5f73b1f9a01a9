#!/usr/bin/env bash
# The GPU box's stages, one bash function each, run by `python3 scripts/device.py stage NAME`
# (which lists them from the `## NAME: help` lines). Each runs in the repository root under
# `set -uo pipefail` with $COMMIT (the commit results name), $RES (this call's results folder),
# $SCRATCH (run folders) and $QUACK (the quack impls, where quack runs here) set; variables in
# the help lines pick subsets. Work that adds up across calls of one commit is kept in
# /tmp/gpu-KIND-$COMMIT (a machine's /tmp lasts while it stays warm). Output names carry the
# GPU's tag, $GPU: h100 or h200 from the device name (set GPU to override).
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}')}
GPU=${GPU:-gpu}

# A step of the recipe's CPU-sized default model is launch-bound on an H200 (30 ms): time a
# model whose GEMMs dominate instead.
MEGATRON_GPU="--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 8"
# A model where TP matters. Selective recompute drops the local spec's unfused attention scores
# (1 GiB a layer at s = 4096), which would crowd TP=1 out; the MLPs' saved tensors are untouched.
SCALE4_MODEL=${SCALE4_MODEL:-"--num-layers 16 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --recompute-granularity selective"}
FP8_QUACK=$([ -n "$QUACK" ] && echo drop_h_quack+fp8)
prior_e2e() {  # DIR NAME: an earlier call's rounds ($E2E_PRIOR/NAME, carried) to --append to
  [ -n "${E2E_PRIOR:-}" ] && [ -f "$E2E_PRIOR/$2" ] && [ ! -f "$1/$2" ] && cp "$E2E_PRIOR/$2" "$1/"
  return 0
}
scale4_run() {  # IMPL LAYOUT ARGS...: every layout at a global batch of 2 sequences
  local impl=$1 layout=$2 n par; shift 2
  case $layout in
    tp1) n=1 par="--tp 1 --num-microbatches 2" ;;
    tp4) n=4 par="--tp 4 --num-microbatches 2" ;;
    tp2dp2) n=4 par="--tp 2 --dp 2 --num-microbatches 1" ;;
  esac
  torchrun --nproc-per-node "$n" recipes/pretrain_megatron.py --mlp-impl "$impl" $par \
    $SCALE4_MODEL --output-dir "$SCRATCH/megatron-scale4" "$@"
}
reshard() {  # DIR EXTRA SRC_IMPL:TP TARGET_IMPL:TP...: save at step 3, resume by each target
  local dir=$1 extra=$2 src=$3 run; shift 3
  run="recipes/pretrain_megatron.py --max-steps 6 --output-dir $SCRATCH/megatron-runs $extra"
  local impl=${src%:*} tp=${src#*:}
  torchrun --nproc-per-node "$tp" $run --tp "$tp" --mlp-impl "$impl" \
    --save "$SCRATCH/mck-$impl-$tp" --save-interval 3 > "$dir/reshard_${impl}_tp${tp}_full.log" 2>&1
  for target in "$@"; do
    local t_impl=${target%:*} t_tp=${target#*:}
    local log="$dir/reshard_${t_impl}_tp${t_tp}_from_${impl}_tp$tp.log"
    torchrun --nproc-per-node "$t_tp" $run --tp "$t_tp" --mlp-impl "$t_impl" \
      --load "$SCRATCH/mck-$impl-$tp/iter_0000003" > "$log" 2>&1
    python3 benchmarks/resume_check.py "$dir/reshard_${impl}_tp${tp}_full.log" "$log" \
      "$impl TP$tp -> $t_impl TP$t_tp" --out "$RES/resume_checks.jsonl"
  done
}

rotate() {  # WORD...: the words with the first moved last, so no impl always runs first
  echo "$@" | awk '{for (i = 2; i <= NF; i++) printf "%s ", $i; print $1}'
}
pretrain_run() {  # NAME DIR ARGS...: one pretrain run, its summary DIR/NAME.json, its log and
  local name=$1 dir=$2  # (checkpoints dropped) output in $SCRATCH
  shift 2
  python3 -m swiglu_train pretrain "$@" --output-dir "$SCRATCH/$name" \
    --summary-json "$dir/$name.json" > "$SCRATCH/$name.log" 2>&1 || tail -5 "$SCRATCH/$name.log"
  rm -rf "$SCRATCH/$name/checkpoints"
}
ab_config() {  # SEED STEPS OUT: the 125M config at a seed (init and data order) and step count
  python3 -c "import sys, yaml; from swiglu_train.integrations.lightning.config import resolve_config_path as path
s, n = int(sys.argv[1]), int(sys.argv[2]); cfg = yaml.safe_load(path('125m').read_text()); cfg['data']['seed'] = s
cfg['train'].update(seed=s, max_steps=n, val_check_interval=n, checkpoint_every=n)
open(sys.argv[3], 'w').write(yaml.safe_dump(cfg))" "$1" "$2" "$3"
}

ab_report() {  # DIR STAGE RUNS TITLE: the runs' summaries into $RES, and the A/B once all ran
  local dir=$1 stage=$2
  cp "$dir"/ab_* "$RES/$stage/"
  if [ "$(ls "$dir"/ab_*_seed*.json | wc -l)" != "$3" ]; then echo "$stage: run it again"; return 0; fi
  python3 benchmarks/plot_loss_ab.py "$dir"/ab_*_seed*.json --last 100 --smooth 50 --commit "$COMMIT" \
    --title "$4" --command "python3 scripts/device.py stage $stage" \
    --json "$RES/${stage}_125m_${GPU}.json" --md "$RES/${stage}_125m_${GPU}.md" \
    --plot "$RES/${stage}_125m_${GPU}.png"
}

# e2e_1b / e2e_3b: rounds add up across calls (--append): where 3 rounds overrun a call,
# E2E_ROUNDS=1 E2E_PLANNER=0 twice, then E2E_ROUNDS=1. At 3B the planner alone takes ~6 min at 2
# budgets with 5 impls: E2E_BUDGETS=auto:2 there. The JSON is written after every point.
e2e_lightning() {  # SIZE GRID MICRO_BATCH
  local size=$1 grid=$2 mbs=$3
  local E2E=/tmp/gpu-e2e-$COMMIT name=e2e_${size}_${GPU} && mkdir -p "$E2E" "$RES/e2e"
  prior_e2e "$E2E" $name.json
  python3 benchmarks/bench_e2e.py lightning --config "$size" --seq-length 4096 \
    --micro-batch-size "$mbs" --global-batch-size "${E2E_GBS:-32}" \
    --impls "${E2E_IMPLS:-$(echo normal drop_h $QUACK drop_h+fp8 | tr ' ' ',')}" \
    --checkpoint-layers "$grid" --rounds "${E2E_ROUNDS:-3}" --budgets-gb "${E2E_BUDGETS:-auto:4}" \
    $([ "${E2E_PLANNER:-1}" = 1 ] && echo --planner) --commit "$COMMIT" --append \
    --json "$E2E/$name.json" --md "$E2E/$name.md" --plot "$E2E/$name.png" \
    2>&1 | grep -v "^planner:" | tail -40
  cp "$E2E"/$name.* "$RES/e2e/"
}

## setup: install the carried wheel folders
stage_setup() {
  python3 scripts/device.py setup
}

## tests: the gpu tests (parallel where .whlt is carried), then the gpu_alone ones alone
stage_tests() {
  # -v: a call cut at its limit still shows each test's outcome. pretrain's tests log to
  # W&B: they skip unless .whlw was installed too.
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
  python3 -m pytest -v -rfE -m "gpu and not gpu_alone" -p no:cacheprovider $workers \
    --durations=12 > "$RES/pytest.log" 2>&1
  python3 -m pytest -v -rfE -m "gpu and gpu_alone" -p no:cacheprovider >> "$RES/pytest.log" 2>&1
  grep -E "(FAILED|ERROR) |passed|failed" "$RES/pytest.log" | tail -25
}

## tune: the gated GEMM's configs against cuBLAS ($TUNE_SHAPES)
stage_tune() {
  python3 benchmarks/tune_gated_gemm.py --samples 30 --json "$RES/tune_gated_${GPU}.json" \
    ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} 2>&1 | grep -v "^ "
}

## sweep: every gated GEMM config at small M, and its tile table ($SWEEP_SHAPES)
stage_sweep() {
  python3 benchmarks/sweep_gated_configs.py --samples 30 --commit "$COMMIT" \
    ${SWEEP_SHAPES:+--shapes $SWEEP_SHAPES} ${SWEEP_EXTRA_TILES:+--extra-tiles $SWEEP_EXTRA_TILES} \
    --json "$RES/sweep_gated_${GPU}.json" --md "$RES/sweep_gated_${GPU}.md" \
    --table "$RES/gated_tiles_${GPU}.json"
}

## bench: swiglu-train bench at the seed shape, every variant
stage_bench() {
  python3 -m swiglu_train bench --samples 40 --commit "$COMMIT" --json "$RES/mlp_${GPU}.json" \
    2>&1 | tail -30
}

## stack: swiglu-train bench-memory for every impl, with the profiler's overhead
stage_stack() {
  python3 -m swiglu_train bench-memory --layers 1,2,4 --mlp-impl normal,drop_h,save_factors \
    --overhead-samples 30 --json "$RES/stack_${GPU}.json" 2>&1 | tail -20
}

## crossover: swiglu-train bench-crossover on its default grid, and auto's table
stage_crossover() {
  python3 -m swiglu_train bench-crossover --commit "$COMMIT" \
    --json "$RES/crossover_${GPU}.json" --auto-model "$RES/auto_${GPU}.json" 2>&1 | tail -40
}

## pretrain: 125M Lightning runs, impls alternated $PRETRAIN_ROUNDS (2) times
stage_pretrain() {
  for round in $(seq "${PRETRAIN_ROUNDS:-2}"); do  # 125M tokens/s moves ±5 % run to run
    for impl in normal drop_h save_factors $QUACK; do
      python3 -m swiglu_train pretrain --config 125m --mlp-impl "$impl" --max-steps 40 \
        --output-dir "$SCRATCH/pt-$impl-$round" --summary-json "$RES/pretrain_${impl}_$round.json" \
        > "$SCRATCH/pt-$impl-$round.log" 2>&1 || tail -5 "$SCRATCH/pt-$impl-$round.log"
    done
  done
  python3 benchmarks/summarize_runs.py "$RES"/pretrain_*_[0-9]*.json --commit "$COMMIT" \
    --title "125M Lightning pretrain, bf16, 40 steps (impls alternated, ${PRETRAIN_ROUNDS:-2} rounds)" \
    --command "python3 scripts/device.py stage pretrain" \
    --json "$RES/pretrain_125m_${GPU}.json" --md "$RES/pretrain_125m_${GPU}.md" \
    && cat "$RES/pretrain_125m_${GPU}.md"
}

## microbatch: the largest micro-batch per impl ($MICROBATCH_CONFIGS: 1b)
stage_microbatch() {
  impls=$(echo normal drop_h drop_h+fp8 $QUACK $FP8_QUACK | tr ' ' ',')
  for config in ${MICROBATCH_CONFIGS:-1b}; do
    python3 benchmarks/max_micro_batch.py --config "$config" --mlp-impl "$impls" \
      --commit "$COMMIT" --json "$RES/max_micro_batch_$config.json"
  done
}

## fp8_lightning: after-forward and peak of the Lightning models, FP8-saved or not
stage_fp8_lightning() {
  for config in ${FP8_LIGHTNING_CONFIGS:-125m 1b}; do
    for impl in normal drop_h drop_h+fp8 ${FP8_QUACK:+drop_h_quack $FP8_QUACK}; do
      fp8=$([ "${impl%+fp8}" != "$impl" ] && echo --saved-fp8 || echo --no-saved-fp8)
      run="fp8mem_${config}_${impl/+/_}"
      python3 -m swiglu_train pretrain --config "$config" --mlp-impl "${impl%+fp8}" $fp8 \
        --max-steps "${FP8_LIGHTNING_STEPS:-20}" --output-dir "$SCRATCH/$run" \
        --summary-json "$RES/${run}_1.json" > "$SCRATCH/$run.log" 2>&1 || tail -5 "$SCRATCH/$run.log"
      rm -rf "$SCRATCH/$run/checkpoints"
    done
    python3 benchmarks/summarize_runs.py "$RES"/fp8mem_${config}_*_1.json --commit "$COMMIT" \
      --title "$config Lightning pretrain, bf16-mixed, ${FP8_LIGHTNING_STEPS:-20} steps: FP8-saved preactivation against bf16" \
      --command "python3 scripts/device.py stage fp8_lightning" \
      --json "$RES/fp8_lightning_${config}_${GPU}.json" --md "$RES/fp8_lightning_${config}_${GPU}.md" \
      && cat "$RES/fp8_lightning_${config}_${GPU}.md"
  done
}

## megatron: recipes/pretrain_megatron.py at TP=1 per impl, 2 rounds, order reversed
stage_megatron() {
  order="stock stock_eager normal drop_h save_factors $QUACK"
  for round in 1 2; do  # reversed in the second, so no impl always runs first
    for impl in $order; do
      torchrun --nproc-per-node 1 recipes/pretrain_megatron.py --mlp-impl "$impl" \
        $MEGATRON_GPU --max-steps 30 --output-dir "$SCRATCH/megatron-runs" \
        --summary-json "$RES/megatron_tp1_${impl}_$round.json" 2>&1 | tail -1
    done
    order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
  done
  python3 benchmarks/summarize_runs.py "$RES"/megatron_tp1_*_[12].json --commit "$COMMIT" \
    --title "Megatron recipe, TP=1, bf16 Float16Module + DistributedOptimizer, 30 steps, $MEGATRON_GPU (2 rounds, order reversed)" \
    --command "python3 scripts/device.py stage megatron" \
    --json "$RES/megatron_${GPU}_tp1.json" --md "$RES/megatron_${GPU}_tp1.md" \
    && cat "$RES/megatron_${GPU}_tp1.md"
}

## e2e_1b: bench_e2e.py lightning, ~1B: impl x checkpointed blocks, rounds, the planner
stage_e2e_1b() {
  e2e_lightning 1b "${E2E_GRID_1B:-0,4,8,12,16}" "${E2E_MBS_1B:-4}"
}

## e2e_moe_1b: bench_e2e.py lightning, moe_1b (1.08B active): experts impl x checkpointed blocks, rounds, the planner
stage_e2e_moe_1b() {
  E2E_IMPLS=${E2E_IMPLS:-$(echo normal drop_h drop_h+fp8 $(echo $QUACK | grep -o drop_h_quack) | tr ' ' ',')} \
    e2e_lightning moe_1b "${E2E_GRID_MOE_1B:-0,8,16}" "${E2E_MBS_MOE_1B:-2}"
}

## e2e_3b: bench_e2e.py lightning, ~3B: impl x checkpointed blocks, rounds, the planner
stage_e2e_3b() {
  e2e_lightning 3b "${E2E_GRID_3B:-0,7,14,21,28}" "${E2E_MBS_3B:-2}"
}

## e2e_megatron: bench_e2e.py megatron: TP=1 stock (fused, eager, Liger's) vs ours, rounds
stage_e2e_megatron() {
  # $E2E_MEGATRON_ARGS (e.g. --manual-gc) go to every run, $E2E_MEGATRON_TAG names the
  # files; E2E_SAMPLE_HOST=1 samples every run with py-spy (.whlw), E2E_SAMPLE_NATIVE=1
  # C frames too; the first run of each of $E2E_PROFILE_MEGATRON profiles its last step.
  E2E=/tmp/gpu-e2e-$COMMIT && mkdir -p "$E2E" "$RES/e2e"
  name=e2e_megatron_tp1${E2E_MEGATRON_TAG:+_$E2E_MEGATRON_TAG}_${GPU}
  prior_e2e "$E2E" $name.json
  liger=$(python3 -c "import liger_kernel.megatron" 2>/dev/null && echo liger)
  # the box's busiest processes every 10 s: host contention would show
  top -b -d 10 -o %CPU -w 160 2>&1 | awk '/^top -/ {n = 0} n++ < 16 {print; fflush()}' \
    > "$RES/e2e/$name.top.log" & watcher=$!
  impls=${E2E_MEGATRON_IMPLS:-$(echo stock stock_eager $liger normal drop_h save_factors $QUACK | tr ' ' ',')}
  python3 benchmarks/bench_e2e.py megatron --impls "$impls" --rounds "${E2E_ROUNDS_MEGATRON:-1}" \
    --warmup 5 --steps 20 --commit "$COMMIT" --append \
    --profile-impls "${E2E_PROFILE_MEGATRON-stock,stock_eager,normal}" --profile-dir "$E2E" \
    ${E2E_SAMPLE_HOST:+--sample-host "$E2E/host_$name"} ${E2E_SAMPLE_NATIVE:+--sample-native} \
    --json "$E2E/$name.json" --md "$E2E/$name.md" -- $MEGATRON_GPU ${E2E_MEGATRON_ARGS:-} 2>&1 | tail -20
  kill $watcher
  cp "$E2E"/$name.* "$RES/e2e/"
  [ -d "$E2E/host_$name" ] && cp -r "$E2E/host_$name" "$RES/e2e/"
  for prof in "$E2E"/profile_megatron_*.json; do
    [ -f "$prof" ] || continue
    impl=$(basename "$prof" .json) && impl=${impl#profile_megatron_}
    cp "$prof" "$RES/e2e/profile_megatron_tp1_${impl}_${GPU}.json"
  done
}

## megatron_moe: bench_e2e.py megatron with MoE layers ($MEGATRON_MOE: 8 experts, top-2): SequentialMLP (stock) vs ours, 3 rounds
stage_megatron_moe() {
  E2E=/tmp/gpu-e2e-$COMMIT && mkdir -p "$E2E" "$RES/e2e" && name=e2e_megatron_moe_${GPU}
  prior_e2e "$E2E" $name.json
  python3 benchmarks/bench_e2e.py megatron \
    --impls "${MEGATRON_MOE_IMPLS:-$(echo stock drop_h $(echo $QUACK | grep -o drop_h_quack) | tr ' ' ',')}" \
    --rounds "${MEGATRON_MOE_ROUNDS:-3}" --warmup 5 --steps 20 --commit "$COMMIT" --append \
    --json "$E2E/$name.json" --md "$E2E/$name.md" -- $MEGATRON_GPU \
    ${MEGATRON_MOE:---num-experts 8 --moe-router-topk 2} 2>&1 | tail -20
  cp "$E2E"/$name.* "$RES/e2e/"
}

## megatron_plan: the recipe's own planner at $MEGATRON_PLAN_GB (30, under the ~39 GB peak)
stage_megatron_plan() {
  torchrun --standalone --nproc-per-node 1 recipes/pretrain_megatron.py $MEGATRON_GPU \
    --activation-checkpointing auto --memory-budget-gb "${MEGATRON_PLAN_GB:-30}" \
    --max-steps 10 --output-dir "$SCRATCH/megatron-plan" \
    --summary-json "$RES/megatron_plan_${GPU}.json" 2>&1 | grep -E "^plan:|^step 9 "
}

## megatron_resume: DistributedOptimizer dist-ckpt: save at step 3, resume, same losses
stage_megatron_resume() {
  for impl in ${RESUME_IMPLS:-normal save_factors}; do reshard "$RES" "" "$impl:1" "$impl:1"; done
}

## megatron_tp2 (2 GPUs): TP=2 against TP=1 from one init: losses, per-GPU memory
stage_megatron_tp2() {
  mkdir -p "$RES/tp"
  for impl in normal drop_h save_factors; do
    for tp in 1 2; do
      torchrun --nproc-per-node "$tp" recipes/pretrain_megatron.py --mlp-impl "$impl" \
        --tp "$tp" --cpu-init $MEGATRON_GPU --max-steps 50 --output-dir "$SCRATCH/megatron-tp" \
        --summary-json "$RES/tp/megatron_tp${tp}_$impl.json" 2>&1 | tail -1
    done
  done
  python3 benchmarks/compare_tp.py "$RES"/tp/*.json --commit "$COMMIT" \
    --title "Megatron TP=2 against TP=1, bf16, 50 steps, $MEGATRON_GPU" \
    --command "python3 scripts/device.py stage megatron_tp2" \
    --json "$RES/megatron_tp2_vs_tp1_${GPU}.json" --md "$RES/megatron_tp2_vs_tp1_${GPU}.md" \
    --plot "$RES/megatron_tp2_vs_tp1_${GPU}.png"
}

## megatron_reshard (2 GPUs): a packed TP=2 checkpoint resumed canonical at TP=1, and back
stage_megatron_reshard() {
  reshard "$RES" "" save_factors:2 normal:1
  reshard "$RES" "" drop_h:1 save_factors:2
}

## lightning_ddp (2 GPUs): the 125M pretrain under DDP on 2 GPUs: one W&B run, one summary
stage_lightning_ddp() {
  python3 -m swiglu_train pretrain --config 125m --mlp-impl drop_h --devices 2 \
    --strategy ddp --max-steps 40 --output-dir "$SCRATCH/pt-ddp" \
    --summary-json "$RES/pretrain_ddp_drop_h.json" > "$RES/pretrain_ddp.log" 2>&1 \
    || tail -5 "$RES/pretrain_ddp.log"
  echo "W&B offline runs: $(ls -d "$SCRATCH"/pt-ddp/wandb/offline-run-* | wc -l)"
}

## scale4 (4 GPUs): Megatron at TP=1, TP=4, TP=2xDP=2 from one init, 50 steps ($SCALE4_IMPLS)
stage_scale4() {
  S4=/tmp/gpu-scale4-$COMMIT && mkdir -p "$S4" "$RES/scale4"  # a run done is skipped
  for impl in ${SCALE4_IMPLS:-stock normal drop_h $QUACK}; do
    for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do
      run="$S4/megatron_${layout}_${impl}_1"
      [ -f "$run.json" ] && continue
      scale4_run "$impl" "$layout" --cpu-init --max-steps 50 --summary-json "$run.json" \
        > "$run.log" 2>&1 || tail -5 "$run.log"
    done
  done
  cp "$S4"/*.json "$RES/scale4/"
  python3 benchmarks/compare_tp.py "$S4"/megatron_*_1.json --commit "$COMMIT" \
    --title "Megatron TP=4 and TP=2xDP=2 against TP=1, bf16, 50 steps, $SCALE4_MODEL" \
    --command "python3 scripts/device.py stage scale4" \
    --json "$RES/scale4/megatron_layouts_${GPU}.json" --md "$RES/scale4/megatron_layouts_${GPU}.md" \
    --plot "$RES/scale4/megatron_layouts_${GPU}.png"
}

## scale4_rounds (4 GPUs): tokens/s rounds $SCALE4_ROUNDS ('2 3') of scale4's runs, order rotated
stage_scale4_rounds() {
  S4=/tmp/gpu-scale4-$COMMIT && mkdir -p "$S4" "$RES/scale4"
  order="${SCALE4_IMPLS:-stock normal drop_h $QUACK}"
  for round in ${SCALE4_ROUNDS:-2 3}; do
    order=$(rotate $order)
    for impl in $order; do
      for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do  # no --cpu-init: weights may differ
        json="$S4/megatron_${layout}_${impl}_$round.json"
        [ -f "$json" ] || scale4_run "$impl" "$layout" --max-steps 20 --warmup-steps 5 \
          --summary-json "$json" 2>&1 | tail -1
      done
    done
  done
  cp "$S4"/*.json "$RES/scale4/"
  for layout in ${SCALE4_LAYOUTS:-tp1 tp4 tp2dp2}; do
    out="$RES/scale4/megatron_${layout}_rounds_${GPU}"
    python3 benchmarks/summarize_runs.py "$S4"/megatron_${layout}_*_[0-9]*.json --commit "$COMMIT" \
      --title "Megatron $layout, bf16, tokens/s over rounds, $SCALE4_MODEL" \
      --command "python3 scripts/device.py stage scale4 scale4_rounds" \
      --json "$out.json" --md "$out.md" && cat "$out.md"
  done
}

## scale4_reshard (4 GPUs): a save_factors TP=4 checkpoint resumed at TP=1 (normal, stock), TP=2
stage_scale4_reshard() {
  mkdir -p "$RES/scale4"
  reshard "$RES/scale4" "$MEGATRON_GPU" save_factors:4 normal:1 stock:1 drop_h:2
}

## scale4_lightning (4 GPUs): 125M on 4 GPUs (fsdp2) vs 1 at one global batch; 1B's plan on 4
stage_scale4_lightning() {
  out="$RES/scale4" && mkdir -p "$out"
  for impl in ${SCALE4_LIGHTNING_IMPLS:-normal drop_h save_factors $QUACK}; do
    for gpus in 4 1; do
      if [ "$gpus" = 4 ]; then extra="--strategy fsdp2"; else extra="--micro-batch-size 32"; fi
      python3 -m swiglu_train pretrain --config 125m --mlp-impl "$impl" --devices "$gpus" \
        $extra --max-steps 40 --output-dir "$SCRATCH/pt$gpus-$impl" \
        --summary-json "$out/lightning_${gpus}gpu_$impl.json" \
        > "$out/lightning_${gpus}gpu_$impl.log" 2>&1 || tail -5 "$out/lightning_${gpus}gpu_$impl.log"
    done
  done
  # the planner measures one device: plan on 1 GPU, then run its choice on 4 under fsdp2
  python3 -m swiglu_train pretrain --config 1b --activation-checkpointing auto --devices 1 \
    --max-steps 20 --output-dir "$SCRATCH/pt1-plan" --summary-json "$out/lightning_1gpu_planner.json" \
    > "$out/lightning_1gpu_planner.log" 2>&1 || tail -5 "$out/lightning_1gpu_planner.log"
  read -r impl layers < <(python3 -c "import json, sys; p = json.load(open(sys.argv[1]))['plan']; print(p['impl'], p['checkpoint_layers'])" "$out/lightning_1gpu_planner.json")
  python3 -m swiglu_train pretrain --config 1b --mlp-impl "$impl" --checkpoint-layers "$layers" \
    --devices 4 --strategy fsdp2 --max-steps 20 --output-dir "$SCRATCH/pt4-plan" \
    --summary-json "$out/lightning_4gpu_planned.json" > "$out/lightning_4gpu_planned.log" 2>&1 \
    || tail -5 "$out/lightning_4gpu_planned.log"
  python3 benchmarks/compare_device_counts.py "$out" --json "$out/lightning_4gpu_vs_1gpu_${GPU}.json"
}

## inference: swiglu-train bench-inference, one JSON per model ($INFERENCE_MODELS)
stage_inference() {
  # merge with `swiglu-train bench-inference --merge ... --json --md --dispatch-table`
  mkdir -p "$RES/inference"
  for model in ${INFERENCE_MODELS:-0.5b 7b 32b 72b}; do
    python3 -m swiglu_train bench-inference --models "$model" --samples 30 --commit "$COMMIT" \
      --json "$RES/inference/$model.json" --md "$RES/inference/$model.md" 2>&1 | tail -40
  done
}

## fuzz: benchmarks/fuzz_gpu.py: $FUZZ_CASES (1000) random cases, every impl, 8 workers
stage_fuzz() {
  python3 benchmarks/fuzz_gpu.py --cases "${FUZZ_CASES:-1000}" --workers 8 \
    --max-seconds "${FUZZ_SECONDS:-420}" --json "$RES/fuzz_gpu_${GPU}.json" 2>&1 | tail -8
}

## fp8_errors: FP8-saved errors at the grid's (D, F), M = $FP8_ERRORS_M ($FP8_ERRORS_IMPLS)
stage_fp8_errors() {
  for impl in ${FP8_ERRORS_IMPLS:-drop_h drop_h_quack}; do  # drop_h_quack: _quack
    python3 benchmarks/measure_fp8_saved.py --device cuda --grid-m "${FP8_ERRORS_M:-8000}" \
      --impl "$impl" --json "$RES/fp8_saved_errors_grid${impl#drop_h}_${GPU}.json" 2>&1 | tail -12
  done
}

## gemm_defaults: quack (static, dynamic) vs cuBLAS per GEMM choice at the grid ($GRID_M)
stage_gemm_defaults() {
  python3 benchmarks/gemm_defaults.py ${GRID_M:+--m ${GRID_M//,/ }} \
    --json "$RES/probe_gemm_defaults_${GPU}.json" 2>&1 | tail -8
}

## patch: a patched HF and LitGPT Llama vs unpatched and Liger (carry .whlh)
stage_patch() {
  for lib in hf litgpt; do
    python3 benchmarks/bench_patch_hf.py --library $lib --layers 4 --seq 4096 --samples 30 \
      --out "$RES/patch_${lib}_${GPU}.json" 2>&1 | tail -12
  done
}

## fp8_loss_ab: 125M drop_h bf16 vs --saved-fp8, seeds 1 and 2, $FP8_AB_STEPS (1000)
stage_fp8_loss_ab() {
  # ~7 min for the four runs; one done is skipped, so a call cut short is finished by the next
  AB=/tmp/gpu-fp8ab-$COMMIT && steps=${FP8_AB_STEPS:-1000} && mkdir -p "$AB" "$RES/fp8_loss_ab"
  for seed in 1 2; do  # the seed draws the data order as well as the init
    ab_config "$seed" "$steps" "$AB/125m_seed$seed.yaml"
    for arm in bf16 fp8; do
      run="ab_${arm}_seed$seed" && [ -f "$AB/$run.json" ] && continue
      fp8=$([ "$arm" = fp8 ] && echo --saved-fp8 || echo --no-saved-fp8)
      python3 -m swiglu_train pretrain --config "$AB/125m_seed$seed.yaml" --mlp-impl drop_h \
        $fp8 ${FP8_AB_MBS:+--micro-batch-size $FP8_AB_MBS} --output-dir "$SCRATCH/$run" \
        --summary-json "$AB/$run.json" > "$AB/$run.log" 2>&1 || tail -5 "$AB/$run.log"
      rm -rf "$SCRATCH/$run/checkpoints"  # 1.5 GB a run, not needed
    done
  done
  ab_report "$AB" fp8_loss_ab 4 "125M Lightning pretrain, bf16-mixed, $steps steps: drop_h saving its preactivation in FP8 vs bf16, seeds 1 and 2"
}

## grid: swiglu-train bench-grid, a chunk a call ($GRID_CHUNK, _MODELS, _M, _VARIANTS)
stage_grid() {
  # $GRID_SHAPES "DxF,..." adds shapes no model lists, $GRID_TAG prefixes the chunk tag,
  # $GRID_PREWARM (8) processes compile the points first, GRID_PRETUNE=1 pretunes each.
  # Merge chunks with `swiglu-train bench-grid --merge A B --json --md --plot`.
  chunk=${GRID_CHUNK:-1/1} && tag=${GRID_TAG:-}${chunk/\//of} && mkdir -p "$RES/grid"
  python3 -m swiglu_train bench-grid --commit "$COMMIT" --chunk "$chunk" \
    --prewarm-workers "${GRID_PREWARM:-8}" ${GRID_MODELS:+--models $GRID_MODELS} \
    ${GRID_SHAPES:+--shapes $GRID_SHAPES} ${GRID_M:+--m $GRID_M} \
    ${GRID_VARIANTS:+--variants $GRID_VARIANTS} $([ "${GRID_PRETUNE:-0}" = 1 ] && echo --pretune) \
    --json "$RES/grid/grid_${GPU}_$tag.json" --md "$RES/grid/grid_${GPU}_$tag.md" \
    --plot "$RES/grid/grid_${GPU}_$tag.png" 2>&1 | grep -v "^ " | tail -60
}

## moe: swiglu-train bench-moe, every model and routing, pre-warmed on $MOE_PREWARM (6) workers; Liger in a run of its own, merged ($MOE_MODELS, $MOE_ROUTING, $MOE_VARIANTS, $MOE_LIGER; $MOE_SHAPES, $MOE_TOKENS, $MOE_DEVICE for a CPU dry run)
stage_moe() {
  # torchtitan's columns where .whlmoe was carried, Liger's where .whll was (`setup` installs
  # both); SonicMoE runs in a process of its own (stage sonic), merged with bench-moe --merge.
  # Liger autotunes ~240 Triton configs per shape, timing each on the GPU (Mixtral's first
  # point, Liger among its variants, did not finish in 480 s on the H100, and a traceback at
  # 70 s was in Liger's autotuner): no pre-warm can share that, so it runs after the rest,
  # in a run of its own whose points a bound cannot cost the others, with its picks kept on
  # disk for a later call on this machine (TRITON_CACHE_AUTOTUNING) and each autotune's
  # seconds logged.
  # Each run's whole output is kept in its log, also where the bound stops it.
  mkdir -p "$RES/moe"
  local args="${MOE_MODELS:+--models $MOE_MODELS} ${MOE_SHAPES:+--shapes $MOE_SHAPES}
    ${MOE_TOKENS:+--tokens $MOE_TOKENS} ${MOE_DEVICE:+--device $MOE_DEVICE}
    --routing ${MOE_ROUTING:-balanced,skewed} --samples 30"
  local quack=$(echo $QUACK | grep -q drop_h_quack && echo drop_h_quack,drop_h_quack+fp8,)
  # expandable segments: the DeepSeek-V3 layer (22.5 GiB of weights, as many of gradients)
  # ran out of memory after two models in one process, 15.9 GiB reserved but in pieces (0f1b069)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  python3 -m swiglu_train bench-moe $args $([ "${MOE_TIMELINE:-1}" = 1 ] && echo --timeline) \
    --prewarm-workers "${MOE_PREWARM:-6}" \
    --variants "${MOE_VARIANTS:-normal,drop_h,drop_h+fp8,drop_h+gathered_wgrad,${quack}torchtitan,torchtitan_compile,hf_grouped_mm}" \
    --out "$RES/moe/moe_main_${GPU}.json" 2>&1 | tee "$RES/moe/moe_main_${GPU}.log" | grep "^\[" | tail -20
  [ "${MOE_LIGER:-1}" = 1 ] || return 0
  TRITON_CACHE_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1 python3 -m swiglu_train bench-moe $args \
    --variants liger --out "$RES/moe/moe_liger_${GPU}.json" 2>&1 \
    | tee "$RES/moe/moe_liger_${GPU}.log" | grep "^\[\|autotuning for\|finished after" | tail -40
  python3 -m swiglu_train bench-moe --merge "$RES/moe/moe_main_${GPU}.json" \
    --merge "$RES/moe/moe_liger_${GPU}.json" --out "$RES/moe/moe_${GPU}.json" | tail -3
}

## moe_llama4: bench-moe with the router weight on the expert input, as Llama-4 runs it: ours against transformers' Llama4TextExperts ($MOE_MODELS, default llama4-scout)
stage_moe_llama4() {
  mkdir -p "$RES/moe"
  python3 -m swiglu_train bench-moe --models "${MOE_MODELS:-llama4-scout}" --router-weights-on input \
    --routing "${MOE_ROUTING:-balanced}" --samples 30 \
    --variants "normal,drop_h,drop_h+fp8,drop_h+gathered_wgrad,$(echo $QUACK | grep -q drop_h_quack && echo drop_h_quack,)hf_llama4" \
    --out "$RES/moe/moe_llama4_${GPU}.json" 2>&1 | tee "$RES/moe/moe_llama4_${GPU}.log" \
    | grep "^\[" | tail -20
}

## moe_gemms: drop_h_quack's six varlen GEMMs, quack configs vs its default and torch's grouped GEMM ($MOE_MODELS, $MOE_ROUTING, $MOE_GEMM_CONFIGS)
stage_moe_gemms() {
  # ~2.5 min on an H100 at the six default models, both routings (~5 if quack's compile pool
  # does not start and its ~70 kernels compile one by one); the files are rewritten per point
  mkdir -p "$RES/moe"
  python3 benchmarks/sweep_moe_gemm_configs.py --commit "$COMMIT" --samples 30 \
    ${MOE_MODELS:+--models $MOE_MODELS} ${MOE_ROUTING:+--routing $MOE_ROUTING} \
    ${MOE_GEMM_CONFIGS:+--configs $MOE_GEMM_CONFIGS} \
    --json "$RES/moe/moe_gemm_configs_${GPU}.json" --md "$RES/moe/moe_gemm_configs_${GPU}.md" 2>&1 | tail -40
}

## moe_wgrad: drop_h's grad_W1 with x's rows gathered inside the Triton GEMM (gathered_wgrad) vs gathered first, vs torch's grouped GEMM ($MOE_MODELS)
stage_moe_wgrad() {
  # ~1 min on an H100 at the five default models, both routings (the Triton GEMM autotunes
  # 5 tiles per shape first)
  mkdir -p "$RES/moe"
  python3 benchmarks/experts_wgrad.py --commit "$COMMIT" --samples 30 ${MOE_MODELS:+--models $MOE_MODELS} \
    --json "$RES/moe/moe_wgrad_${GPU}.json" --md "$RES/moe/moe_wgrad_${GPU}.md" 2>&1 | tail -40
}

## host: benchmarks/profile_host.py, where a step's host time goes, one file per case ($HOST_CASES; carry .whla for the fp8 cases)
stage_host() {
  # an FP8 case compiles first (an 80 s bound cut both FP8 cases on the H100, 0d37874): each
  # case gets $HOST_SECONDS (240) of its own, so one slow compile costs the others nothing
  mkdir -p "$RES/host"
  local case
  for case in ${HOST_CASES:-experts:drop_h_quack:qwen3-30b-a3b fp8:tensorwise fp8:tensorwise:compile}; do
    timeout "${HOST_SECONDS:-240}" python3 benchmarks/profile_host.py "$case" \
      --out "$RES/host/host_${case//:/_}_${GPU}.txt" 2>&1 | grep "ms/step" || echo "$case: no profile"
  done
}

## sonic: SonicMoE beside drop_h in a process of its own, its wheels from .whls ($MOE_MODELS, $MOE_ROUTING)
stage_sonic() {
  # .whls (carried alone: 46 MB; `device.py wheels .whls` builds it) holds sonicmoe's snapshot
  # wheel, the quack it pins (with gemm_act), cuda-python and cutlass-dsl 4.2.1 unpacked (its
  # python_packages on the path as its .pth would put them). Never installed into python3's own
  # site (`setup` skips it): our quack stays 0.6.5.
  local site=/tmp/sonic-site
  if [ ! -d "$site/sonicmoe" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whls/*.whl
    tar xJf .whls/cutlass-dsl-*.tar.xz -C "$site"
  fi
  mkdir -p "$RES/moe"
  PYTHONPATH="$site:$site/nvidia_cutlass_dsl/python_packages:$PYTHONPATH" python3 -m swiglu_train \
    bench-moe --models "${MOE_MODELS:-qwen3-30b-a3b,olmoe-1b-7b}" --routing "${MOE_ROUTING:-balanced}" \
    --samples 30 --variants drop_h,drop_h+fp8,sonicmoe --out "$RES/moe/moe_sonic_${GPU}.json" 2>&1 \
    | tee "$RES/moe/moe_sonic_${GPU}.log" | tail -20
}

## fp8_training: the FP8-GEMM GPU tests, then drop_h (and drop_h+fp8, its preact in FP8) on torchao's recipes against torchao's MLP, both compiled ($FP8_MODELS, $FP8_VARIANTS; carry .whla)
stage_fp8_training() {
  mkdir -p "$RES/fp8"
  python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_fp8_training.py \
    > "$RES/fp8/gpu_tests_fp8_training_${GPU}.txt" 2>&1
  tail -3 "$RES/fp8/gpu_tests_fp8_training_${GPU}.txt"
  python3 -m swiglu_train bench-grid --commit "$COMMIT" --chunk 1/1 --prewarm-workers 8 \
    --m "${FP8_M:-8000}" ${FP8_MODELS:+--models $FP8_MODELS} --variants \
    ${FP8_VARIANTS:-drop_h,save_factors_quack,drop_h_float8_tensorwise_compile,drop_h_float8_rowwise_compile,drop_h+fp8_float8_rowwise_compile,torchao_float8_tensorwise_compile,torchao_float8_rowwise_compile} \
    --json "$RES/fp8/fp8_training_grid_${GPU}.json" --md "$RES/fp8/fp8_training_grid_${GPU}.md" \
    2>&1 | grep -v "^ " | tail -30
}

## float8_loss_ab: 125M, $FP8_AB_STEPS (1000) steps, seeds 1 and 2: drop_h on torchao's $FLOAT8_RECIPE (tensorwise) vs torchao's MLP vs bf16 drop_h
stage_float8_loss_ab() {
  # $FLOAT8_AB_PARALLEL (3) runs share the GPU at once (a 125M step leaves it idle between
  # kernels); a run done is skipped, so a call cut short is finished by the next on this machine
  AB=/tmp/gpu-f8ab-$COMMIT && steps=${FP8_AB_STEPS:-1000} && recipe=${FLOAT8_RECIPE:-tensorwise}
  mkdir -p "$AB" "$RES/float8_loss_ab"
  local running=0 seed arm impl run
  for seed in 1 2; do
    ab_config "$seed" "$steps" "$AB/125m_seed$seed.yaml"
    for arm in drop_h drop_h_float8 normal_float8; do
      run="ab_${arm}_seed$seed" && [ -f "$AB/$run.json" ] && continue
      impl=${arm%_float8}
      python3 -m swiglu_train pretrain --config "$AB/125m_seed$seed.yaml" --mlp-impl "$impl" \
        --no-saved-fp8 $([ "$impl" != "$arm" ] && echo --float8 "$recipe") \
        --output-dir "$SCRATCH/$run" --summary-json "$AB/$run.json" > "$AB/$run.log" 2>&1 \
        || tail -5 "$AB/$run.log" &
      running=$((running + 1))
      if [ "$running" -ge "${FLOAT8_AB_PARALLEL:-3}" ]; then wait -n; running=$((running - 1)); fi
    done
  done
  wait
  rm -rf "$SCRATCH"/ab_*/checkpoints
  ab_report "$AB" float8_loss_ab 6 "125M Lightning pretrain, bf16-mixed, $steps steps: drop_h on torchao's $recipe FP8 recipe vs torchao's FP8 MLP vs bf16 drop_h, seeds 1 and 2 (${FLOAT8_AB_PARALLEL:-3} runs at once)"
}

## float8_1b: the ~1B Lightning model: drop_h on torchao's FP8 recipe vs torchao's MLP vs bf16, $FLOAT8_ROUNDS (2) rounds
stage_float8_1b() {
  local order="drop_h drop_h_float8 normal_float8" recipe=${FLOAT8_RECIPE:-tensorwise} round arm impl
  mkdir -p "$RES/float8_1b"
  for round in $(seq "${FLOAT8_ROUNDS:-2}"); do
    for arm in $order; do
      impl=${arm%_float8}
      pretrain_run "float8_1b_${arm}_$round" "$RES/float8_1b" --config 1b --mlp-impl "$impl" \
        --no-saved-fp8 $([ "$impl" != "$arm" ] && echo --float8 "$recipe") \
        --micro-batch-size "${FLOAT8_MBS:-4}" --max-steps "${FLOAT8_STEPS:-30}"
    done
    order=$(rotate $order)
  done
  python3 benchmarks/summarize_runs.py "$RES"/float8_1b/float8_1b_*_[0-9]*.json --commit "$COMMIT" \
    --baseline drop_h --title "1B Lightning pretrain, seq 4096, micro-batch ${FLOAT8_MBS:-4}, ${FLOAT8_STEPS:-30} steps: FP8 GEMMs ($recipe) against bf16 (arms rotated over rounds)" \
    --command "python3 scripts/device.py stage float8_1b" \
    --json "$RES/float8_1b_${GPU}.json" --md "$RES/float8_1b_${GPU}.md" && cat "$RES/float8_1b_${GPU}.md"
}

## moe_1b: moe_1b as an HF Mixtral (hf:moe_1b): transformers' grouped_mm experts (stock) vs ours, tokens/s and memory, rounds; the largest micro-batch
stage_moe_1b() {
  # bf16-true for every arm: under bf16-mixed, transformers' grouped_mm experts would compute
  # in fp32 (torch's grouped GEMM has no autocast rule), ours in bf16
  local order="stock normal drop_h $(echo $QUACK | grep -o drop_h_quack) drop_h+fp8" round impl
  mkdir -p "$RES/moe_1b"
  for round in $(seq "${MOE_1B_ROUNDS:-2}"); do
    for impl in $order; do
      pretrain_run "moe_1b_${impl/+/_}_$round" "$RES/moe_1b" --config moe_1b --model hf:moe_1b \
        --mlp-impl "${impl%+fp8}" $([ "${impl%+fp8}" != "$impl" ] && echo --saved-fp8) \
        --precision "${MOE_1B_PRECISION:-bf16-true}" --micro-batch-size "${MOE_1B_MBS:-2}" \
        --max-steps "${MOE_1B_STEPS:-20}"
    done
    order=$(rotate $order)
  done
  python3 benchmarks/summarize_runs.py "$RES"/moe_1b/moe_1b_*_[0-9]*.json --commit "$COMMIT" --baseline stock \
    --title "moe_1b as an HF Mixtral (1.08B active of 3.49B), ${MOE_1B_PRECISION:-bf16-true}, seq 4096, micro-batch ${MOE_1B_MBS:-2}, ${MOE_1B_STEPS:-20} steps: transformers' grouped_mm experts (stock) against ours (impls rotated over rounds)" \
    --command "python3 scripts/device.py stage moe_1b" \
    --json "$RES/moe_1b_${GPU}.json" --md "$RES/moe_1b_${GPU}.md" && cat "$RES/moe_1b_${GPU}.md"
  [ "${MOE_1B_MAX_MICRO:-1}" = 1 ] && python3 benchmarks/max_micro_batch.py --config moe_1b \
    --mlp-impl "$(echo $order | sed 's/stock //' | tr ' ' ',')" --limit "${MOE_1B_LIMIT:-8}" --commit "$COMMIT" --json "$RES/max_micro_batch_moe_1b_${GPU}.json"
  return 0
}
