#!/usr/bin/env bash
# One GPU session in one command: install the pure-Python wheels, build the extension for Hopper,
# then run the requested stages, logging each under $OUT (default: ./gpu_out).
#
#   bench/gpu_session.sh [tests] [grid-tests] [op-tests] [bench] [bench-grid] [bench-render] [train] [lego] [lego-in-order]
#                        [lego-torch] [profile] [split-profile] [grid-channels] [variants] [exchange] [syncs] [kernels]
#                        [balance] [rank-alone] [decoder-profile] [run-profile] [host-profile]
#
# tests:      the whole pytest suite (CUDA tests included); grid-tests: tests/test_grid_interpolate*.py only
# op-tests:   the training-step ops' tests (volume_render, sparse_adam_step, march_rays); bench-render: their
#             benchmarks; bench-march: march_rays' alone
# model-tests: tests/test_model.py (the model's CUDA paths: the bfloat16 decoder)
# pytests:    the test files in $PYTEST_ARGS (default tests/test_step_graph.py)
# bench:      bench/bench_ops.py at full size -> $OUT/bench.json, $OUT/bench.md; bench-grid: the grid op only
# train:      the default `python train.py` (built-in scene), custom ops then ops=torch, timed
# lego:       the shipped blender experiment on $LEGO (default ../shared/data/lego_400 or ./lego_400)
# torchrun1:  a short lego run ($SHORT_ITERS, default 2000 steps) under torchrun --nproc_per_node=1 (the NCCL
#             path on one GPU), then the same run without torchrun
# lego-torch: the same with ops=torch; lego-in-order: with CUDA_EXT_GRID_REORDER=off
# profile:    1000 lego steps at the final grid with train.profile=true (where a steady-state step's time goes)
# split-profile: the same on every GPU of the machine under torchrun (train.parallel=auto: the space split, each
#             rank's replays timed as the part step_graph; $SPLIT_ARGS, default capped + step graph, which auto
#             needs to split) -> split_profile/profile.json, profile_rank<r>.json
# run-profile: the lego preset's whole run under train.profile=$RUN_PROFILE (host: no syncs, the default; true: the
#             device synchronised around each part) on one GPU, then under torchrun on every GPU (train.parallel=auto),
#             each profile's 100-step windows side by side -> run_profile.md (bench/profile_windows.py)
# host-profile: the lego preset's whole run under train.profile=host (the host's time in each part, no syncs) for
#             each NAME=OVERRIDES of $HOST_VARIANTS (default: one= and capped + step graph, the split's path on one
#             GPU), their 100-step windows side by side -> host_profile.md, host/<name>/profile.json
# viewer:     bench/viewer_throughput.py on the shipped lego config: viewer off / on with a still / moving
#             simulated browser (needs viser and its dependencies as py3.12 wheels in .whl); extra train.py
#             overrides in $VIEWER_OVERRIDES (e.g. a shorter run: "train.iters=2000 train.eval_final_views=8")
# variants:   bench/quality_runs.py, one run at a time (timed alone), over $VARIANTS ("NAME=OVERRIDES;NAME=...");
#             on $VARIANT_DATA (default lego) with +experiment=$VARIANT_EXPERIMENT (blender | capture); $VARIANT_PARALLEL
#             (default 1) at a time on one device (more: the PSNR only, their times shared)
# peers:      ours and 3DGS (gsplat, needs its wheel in .whl) on each scene of $PEER_SCENES, each run alone, into
#             $OUT/peers/<date>-<scene>.json and .png (bench/peers/gpu_stage.sh: $PEER_DATA, $PEER_STEPS,
#             $CAPTURE_OVERRIDES, $OURS_EXTRA)
# grid-channels: the grid op against F.grid_sample at each of $GRID_CHANNELS (default 1,3,4,7,12,16,24,32)
#                channels -> $OUT/grid_channels.json, .md
# exchange:   bench/bench_grad_exchange.py on every GPU of the machine (torchrun): the grids' gradient exchange,
#             dense / touched rows / occupied rows, -> $OUT/grad_exchange.json ($EXCHANGE_ARGS: e.g. --occupied 0.05)
# ab:         the code against a baseline on one machine (times compare only within one call): each line of $AB_RUNS
#             ("name|tree|scene|experiment|overrides", tree "new" = this checkout, "old" = the Python tree of
#             $AB_OLD_TGZ, or a FILE.tgz path (unpacked once, by its file name): one made with `git archive REF |
#             gzip > FILE`, run with this build's extension, so its Python must not need an op this build lacks;
#             "TREE@N": under torchrun on N GPUs; a sixth field: VAR=VALUE words set in the run's environment, e.g.
#             NCCL_PROTO=Simple) trains
#             `+experiment=experiment data.root=scene`, alone, in order -> $OUT/ab/<name>/metrics.json; interleave
#             old and new lines so drift on the host hits both; AB_STEPS=1: each under bench/step_outliers.py
#             (-> $OUT/ab/<name>.steps.json: every step's host time, garbage collections, cudaMalloc / cudaFree)
# kernels:    bench/kernel_profile.py: torch.profiler over 30 steps from $KERNELS_FIRST (2800) of the
#             +experiment=$KERNELS_EXPERIMENT (blender) run on $KERNELS_DATA (lego) -> $OUT/kernel_profile.txt
#             ($KERNELS_RANKS > 1: under torchrun on that many GPUs, train.parallel=auto; rank r > 0 writes .rank<r>)
# balance:    bench/slab_balance.py on the lego preset: the samples per first-axis cell layer at $BALANCE_AT, and how
#             evenly, at the surface and at the shaded samples' quantiles cut slabs would share them -> $OUT/slab_balance.json
# rank-alone: bench/rank_alone.py: one split rank's step alone (exchanges emulated) against one GPU's, at step
#             $ALONE_AT (2800) of the lego preset, capped + step graph ($ALONE_ARGS: more options) -> $OUT/rank_alone.json
# decoder-profile: bench/decoder_profile.py: the lego preset's per-sample decoder alone, eager, by ATen call and
#             shapes, and its bias gradients' column sums timed several ways -> $OUT/decoder_profile.json
# syncs:      bench/step_syncs.py: the device syncs of lego preset steps 300-319, by site -> $OUT/step_syncs.json
# A stage that fails is logged and the next one still runs; the exit code is the number of failures.
# Everything is written under a work folder and packed into $OUT/session.tgz at the end (the device tool
# returns at most 8 files), with session.log and bench.json beside it.
set -u
FINAL=${OUT:-$PWD/gpu_out}
OUT=/tmp/gpu_session
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests bench)
failures=0

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/session.log"; }
# Stages share one deadline (the device tool stops a command at 10 minutes and then returns nothing),
# so a slow stage is cut short and the results so far still get packed.
DEADLINE=$((SECONDS + ${SESSION_SECONDS:-540}))
stage() {  # stage NAME CMD...: run CMD with its output in $OUT/NAME.log
  local name=$1; shift
  local start=$SECONDS left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then log "skip  $name: session deadline reached"; failures=$((failures + 1)); return; fi
  log "start $name: $*"
  if timeout "$left" "$@" >"$OUT/$name.log" 2>&1; then
    log "ok    $name ($((SECONDS - start)) s)"
  else
    log "FAIL  $name ($((SECONDS - start)) s, exit $?)"; tail -n 40 "$OUT/$name.log"
    failures=$((failures + 1))
  fi
}

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
# in-place build: the GPU machine's pip falls back to `setup.py develop`, which wants to download setuptools
stage build python3 setup.py build_ext --inplace
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
grep -E "spill|registers" "$OUT/build.log" | sort | uniq -c | sort -rn | head -40 >"$OUT/ptxas.txt"
python3 -c "import cuda_ext, torch; assert cuda_ext.has_cuda_kernels(), 'no CUDA kernels built'; print(torch.__version__)" \
  || { log "extension has no CUDA kernels: stopping"; grep -nE "error|Error" "$OUT/build.log" | head -60 >"$FINAL/build_errors.txt"; cp "$OUT/build.log" "$FINAL/"; exit 99; }

LEGO=${LEGO:-}
if [ -z "$LEGO" ]; then
  for candidate in ../shared/data/lego_400 shared/data/lego_400 lego_400 .lego_400; do
    [ -d "$candidate" ] && LEGO=$candidate && break
  done
fi

for s in "${stages[@]}"; do
  case $s in
    tests) stage tests python3 -m pytest -q -rfEs --durations=15 ;;
    grid-tests) stage grid_tests python3 -m pytest -q -rfEs tests/test_grid_interpolate.py tests/test_grid_interpolate_cuda.py ;;
    op-tests) stage op_tests python3 -m pytest -q -rfEs tests/test_render.py tests/test_sparse_adam.py tests/test_march.py ;;
    model-tests) stage model_tests python3 -m pytest -q -rfEs tests/test_model.py ;;
    pytests) stage pytests python3 -m pytest -q -rfEs ${PYTEST_ARGS:-tests/test_step_graph.py} ;;
    bench-render)
      stage bench_render python3 bench/bench_ops.py --device cuda --size full --ops volume_render \
        --json "$OUT/bench_render.json" --markdown "$OUT/bench_render.md"
      stage bench_adam python3 bench/bench_sparse_adam.py
      stage bench_march python3 bench/bench_march.py --json "$OUT/bench_march.json" ;;
    bench-march) stage bench_march python3 bench/bench_march.py --json "$OUT/bench_march.json" ;;
    bench) stage bench python3 bench/bench_ops.py --device cuda --size full --json "$OUT/bench.json" --markdown "$OUT/bench.md" ;;
    bench-grid) stage bench_grid python3 bench/bench_ops.py --device cuda --size full --ops grid \
      --json "$OUT/bench_grid.json" --markdown "$OUT/bench_grid.md" ;;
    train)
      stage train_custom python3 train.py hydra.run.dir="$OUT/train_custom"
      stage train_torch python3 train.py ops=torch hydra.run.dir="$OUT/train_torch" ;;
    lego) stage lego python3 train.py +experiment=blender data.root="$LEGO" hydra.run.dir="$OUT/lego" ;;
    lego-in-order) stage lego_in_order env CUDA_EXT_GRID_REORDER=off python3 train.py +experiment=blender \
      data.root="$LEGO" hydra.run.dir="$OUT/lego_in_order" ;;
    torchrun1) stage torchrun1 python3 -m torch.distributed.run --standalone --nproc_per_node=1 train.py \
      +experiment=blender data.root="$LEGO" train.iters="${SHORT_ITERS:-2000}" train.eval_final_views=8 \
      train.turntable_frames=0 hydra.run.dir="$OUT/torchrun1"
      stage plain1 python3 train.py +experiment=blender data.root="$LEGO" train.iters="${SHORT_ITERS:-2000}" \
      train.eval_final_views=8 train.turntable_frames=0 hydra.run.dir="$OUT/plain1" ;;
    lego-torch) stage lego_torch python3 train.py +experiment=blender data.root="$LEGO" ops=torch hydra.run.dir="$OUT/lego_torch" ;;
    grid-channels) stage grid_channels python3 bench/bench_ops.py --device cuda --size full --ops grid \
      --variants custom,custom-in-order,builtin --grid-channels "${GRID_CHANNELS:-1,3,4,7,12,16,24,32}" --budget-s 1 \
      --json "$OUT/grid_channels.json" --markdown "$OUT/grid_channels.md" ;;
    profile) stage profile python3 train.py +experiment=blender data.root="$LEGO" train.profile=true train.iters=1000 \
      'model.grow_at=[]' train.eval_every=0 train.turntable_frames=0 hydra.run.dir="$OUT/profile" ;;
    split-profile) stage split_profile python3 -m torch.distributed.run --standalone \
      --nproc_per_node="$(nvidia-smi -L | wc -l)" train.py +experiment=blender data.root="$LEGO" train.profile=true \
      train.iters=1000 'model.grow_at=[]' train.eval_every=0 train.eval_final_views=8 train.turntable_frames=0 \
      hydra.run.dir="$OUT/split_profile" ${SPLIT_ARGS-model.capped_samples=true train.step_graph=true} ;;
    run-profile)  # the whole preset run under train.profile (its 100-step windows): one GPU, then every GPU split
      stage run_profile_one python3 train.py +experiment=blender data.root="$LEGO" train.profile="${RUN_PROFILE:-host}" \
        train.eval_final_views=8 train.turntable_frames=0 hydra.run.dir="$OUT/run_profile_one"
      stage run_profile_split python3 -m torch.distributed.run --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" \
        train.py +experiment=blender data.root="$LEGO" train.profile="${RUN_PROFILE:-host}" train.eval_final_views=8 \
        train.turntable_frames=0 hydra.run.dir="$OUT/run_profile_split"
      python3 bench/profile_windows.py "$OUT/run_profile_one/profile.json" "$OUT"/run_profile_split/profile*.json \
        >"$OUT/run_profile.md" 2>&1 ;;
    host-profile)  # the preset's whole run under train.profile=host (no syncs: the host's time a part) per variant
      IFS=';' read -ra specs <<<"${HOST_VARIANTS:-one=;capped=model.capped_samples=true train.step_graph=true}"
      profiles=()
      for spec in "${specs[@]}"; do
        name=${spec%%=*}
        # shellcheck disable=SC2086  # the overrides are words
        stage "host_$name" python3 train.py +experiment=blender data.root="$LEGO" train.profile=host \
          train.eval_final_views=8 train.turntable_frames=0 hydra.run.dir="$OUT/host/$name" ${spec#*=}
        profiles+=("$OUT/host/$name/profile.json")
      done
      python3 bench/profile_windows.py "${profiles[@]}" >"$OUT/host_profile.md" 2>&1 ;;
    viewer) stage viewer_throughput python3 bench/viewer_throughput.py --json "$OUT/viewer_throughput.json" \
      -- +experiment=blender data.root="$LEGO" train.checkpoint_every=0 ${VIEWER_OVERRIDES:-} ;;
    peers) source bench/peers/gpu_stage.sh ;;
    kernels) ranks=(); [ "${KERNELS_RANKS:-1}" -gt 1 ] && ranks=(-m torch.distributed.run --standalone \
        --nproc_per_node="$KERNELS_RANKS")
      stage kernel_profile python3 "${ranks[@]}" bench/kernel_profile.py --out "$OUT/kernel_profile.txt" \
      --first "${KERNELS_FIRST:-2800}" -- +experiment="${KERNELS_EXPERIMENT:-blender}" data.root="${KERNELS_DATA:-$LEGO}" \
      train.turntable_frames=0 hydra.run.dir="$OUT/kernels" ;;
    rank-alone) stage rank_alone python3 bench/rank_alone.py --json "$OUT/rank_alone.json" --at "${ALONE_AT:-2800}" ${ALONE_ARGS:-} -- \
      +experiment=blender data.root="$(realpath "$LEGO")" hydra.run.dir="$OUT/rank_alone_run" model.capped_samples=true \
      train.step_graph=true ;;
    decoder-profile) stage decoder_profile python3 bench/decoder_profile.py --json "$OUT/decoder_profile.json" ;;
    syncs) stage step_syncs python3 bench/step_syncs.py --json "$OUT/step_syncs.json" -- +experiment=blender \
      data.root="$LEGO" train.iters=400 train.eval_final_views=4 train.turntable_frames=0 hydra.run.dir="$OUT/syncs" ;;
    exchange) stage grad_exchange python3 -m torch.distributed.run --standalone \
      --nproc_per_node="$(nvidia-smi -L | wc -l)" bench/bench_grad_exchange.py --json "$OUT/grad_exchange.json" \
      ${EXCHANGE_ARGS:-} ;;
    ab)
      while IFS='|' read -r name tree scene experiment overrides environment; do
        [ -z "$name" ] && continue
        launch=(python3); [ "$tree" != "${tree%@*}" ] && launch=(python3 -m torch.distributed.run --standalone \
          --nproc_per_node="${tree#*@}")  # tree@N: under torchrun on N GPUs
        source_tree=${tree%@*}; [ "$source_tree" = old ] && source_tree=${AB_OLD_TGZ:?ab: set AB_OLD_TGZ}
        dir=$PWD
        if [ "$source_tree" != new ]; then  # a tarball of a Python tree, unpacked once, with this build's extension
          dir=/tmp/ab_trees/$(basename "$source_tree" .tgz)
          if [ ! -d "$dir" ]; then
            mkdir -p "$dir" && tar -xzf "$source_tree" -C "$dir" && cp cuda_ext/_C*.so cuda_ext/_build_config.py "$dir/cuda_ext/"
          fi
        fi
        # AB_STEPS=1: each run under bench/step_outliers.py (every step's host time, collections, driver allocations)
        entry=(train.py); [ "${AB_STEPS:-0}" = 1 ] && entry=("$PWD/bench/step_outliers.py" --root "$dir" \
          --json "$OUT/ab/$name.steps.json" --)
        mkdir -p "$OUT/ab"
        # shellcheck disable=SC2086  # the overrides and the environment's assignments are words
        stage "ab_$name" env -C "$dir" PYTHONPATH="$dir:${PYTHONPATH:-}" ${environment:-} "${launch[@]}" "${entry[@]}" \
          +experiment="$experiment" data.root="$(realpath "$scene")" hydra.run.dir="$OUT/ab/$name" train.turntable_frames=0 $overrides
      done <"${AB_RUNS:?ab: set AB_RUNS}" ;;
    variants)
      args=(); IFS=';' read -ra specs <<<"${VARIANTS:-base=}"
      for spec in "${specs[@]}"; do args+=(--variant "$spec"); done
      stage variants python3 bench/quality_runs.py --data "${VARIANT_DATA:-$LEGO}" \
        --experiment "${VARIANT_EXPERIMENT:-blender}" --parallel "${VARIANT_PARALLEL:-1}" --runs "$OUT/variants" \
        --json "$OUT/variants.json" "${args[@]}" ;;
    balance)
      stage balance python3 bench/slab_balance.py --out "$OUT/slab_balance.json" --at "${BALANCE_AT:-1000,2000,2990}" -- \
        +experiment=blender data.root="$(realpath "$LEGO")" hydra.run.dir="$OUT/balance_run" train.turntable_frames=0 ;;
    *) log "unknown stage $s"; failures=$((failures + 1)) ;;
  esac
done
log "done: $failures failure(s)"
# keep what comes back small: checkpoints and videos stay on the device machine
find "$OUT" \( -name "*.pt" -o -name "*.pt.*.tmp" -o -name "*.mp4" -o -name "*.npy" \) -delete
find "$OUT" -path "*/renders/*" -name "[0-9][0-9][0-9]_*" ! -name "00[0-2]_*" -delete  # three views per run come back
# ab's runs are for their times: one view's prediction each, so a call of many runs still fits the 16 MiB a file
[ -d "$OUT/ab" ] && find "$OUT/ab" -path "*/renders/*" -name "[0-9][0-9][0-9]_*" ! -name "000_pred.png" -delete
tar -C "$OUT" -czf "$FINAL/session.tgz" .
cp "$OUT/session.log" "$FINAL/"; [ -f "$OUT/bench.json" ] && cp "$OUT/bench.json" "$OUT/bench.md" "$FINAL/"
for f in "$OUT"/peers/*.json "$OUT"/peers/*.png; do [ -f "$f" ] && cp "$f" "$FINAL/"; done
for f in kernel_profile.txt kernel_profile.txt.rank1 run_profile.md host_profile.md decoder_profile.json slab_balance.json rank_alone.json grad_exchange.json step_syncs.json variants.json bench_render.md bench_march.json profile/profile.json op_tests.log model_tests.log pytests.log viewer_throughput.json; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FINAL/"; done
exit $failures
