# The `peers` stage of bench/gpu_session.sh, sourced by it (uses its stage, log, failures, $OUT and $LEGO).
#
# Builds gsplat's CUDA code once (JIT, ~104 s on the H100; kept in build/torch_extensions, which a warm machine
# keeps between calls), runs tests/test_peers.py there (its gsplat + GPU tests; PEER_TESTS=0 skips them), profiles
# 3DGS steps on lego_400 (bench.peers.step_profile, ~20 s, its summary printed; PEER_PROFILE=0 skips it), then
# for each scene of $PEER_SCENES (default "lego_400 fruit", folders under $PEER_DATA, default .scenes; lego_400
# falls back to $LEGO), each run alone on the GPU:
#   ours:  python3 train.py +experiment=blender data.root=ROOT (a capture: $CAPTURE_OVERRIDES instead of
#          +experiment=blender, default "+experiment=blender data=nerfstudio"), plus $OURS_EXTRA (default
#          train.turntable_frames=0: no turntable video; training itself is the shipped config)
#   3DGS:  python3 -m bench.peers.run --method gsplat --steps $PEER_STEPS (default 7000), with the data.* overrides
#          of $CAPTURE_OVERRIDES for a capture (the same images and split as ours)
# and records both into $OUT/peers/<date>-<scene>.json and .png (copied beside session.tgz at the end).
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
peer_out="$OUT/peers" peer_date=$(date +%F)  # one date for every run of the stage: one results file per scene
mkdir -p "$peer_out"
stage peers_gsplat_build env MAX_JOBS="${PEER_MAX_JOBS:-32}" python3 -c \
  "from gsplat.cuda._backend import _C; assert _C is not None, 'gsplat: no CUDA extension built'; print('gsplat built')"
[ "${PEER_TESTS:-1}" = 1 ] && stage peers_tests python3 -m pytest -q -rs tests/test_peers.py
# where a 3DGS step's time goes (~20 s): phases, top ops, SSIM and Adam A/B; PEER_PROFILE=0 skips it
if [ "${PEER_PROFILE:-1}" = 1 ]; then
  profile_root="${PEER_DATA:-.scenes}/lego_400"
  [ ! -d "$profile_root" ] && profile_root=${LEGO:-}
  if [ -d "$profile_root" ]; then
    stage peers_gsplat_profile python3 -m bench.peers.step_profile --data-root "$profile_root"
    grep -E "mean step|3dgs/|SSIM|Adam|scene scale|warm-up" "$OUT/peers_gsplat_profile.log"  # the summary
  fi
fi
for scene in ${PEER_SCENES:-lego_400 fruit}; do
  root="${PEER_DATA:-.scenes}/$scene"
  [ ! -d "$root" ] && [ "$scene" = lego_400 ] && [ -n "${LEGO:-}" ] && root=$LEGO
  if [ ! -d "$root" ]; then
    log "FAIL  peers $scene: no scene folder ${PEER_DATA:-.scenes}/$scene"; failures=$((failures + 1)); continue
  fi
  ours=(+experiment=blender) peer_data=()
  if [ -f "$root/transforms.json" ]; then
    read -ra ours <<<"${CAPTURE_OVERRIDES:-+experiment=blender data=nerfstudio}"
    for override in "${ours[@]}"; do
      case $override in data.root=*) ;; data.*) peer_data+=(--data-override "$override") ;; esac
    done
  fi
  read -ra extra <<<"${OURS_EXTRA:-train.turntable_frames=0}"
  run_dir="$peer_out/runs/$scene"
  stage "peers_${scene}_ours" python3 train.py "${ours[@]}" data.root="$root" "${extra[@]}" hydra.run.dir="$run_dir"
  if [ -f "$run_dir/metrics.json" ]; then
    stage "peers_${scene}_ours_record" python3 -m bench.peers.run --scene "$scene" --data-root "$root" \
      --method ours --ours-run "$run_dir" --out "$peer_out" --date "$peer_date"
  fi
  stage "peers_${scene}_gsplat" python3 -m bench.peers.run --scene "$scene" --data-root "$root" --method gsplat \
    --steps "${PEER_STEPS:-7000}" --out "$peer_out" --date "$peer_date" "${peer_data[@]}"
done
