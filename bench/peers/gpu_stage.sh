# The `peers` stage of bench/gpu_session.sh, sourced by it (uses its stage, log, failures, $OUT and $LEGO).
#
# Builds gsplat's CUDA code once (JIT, ~104 s on the H100; kept in build/torch_extensions, which a warm machine
# keeps between calls), runs tests/test_peers*.py there (its gsplat + GPU tests; PEER_TESTS=0 skips them), profiles
# 3DGS steps on lego_400 (bench.peers.step_profile, ~20 s, its summary printed; PEER_PROFILE=0 skips it), then
# for each scene of $PEER_SCENES (default "lego_400 fruit", folders under $PEER_DATA, default .scenes; lego_400
# falls back to $LEGO), each run alone on the GPU:
#   ours:  python3 train.py +experiment=blender data.root=ROOT (a capture: $CAPTURE_OVERRIDES instead of
#          +experiment=blender, default "+experiment=blender data=nerfstudio"), plus $OURS_EXTRA (default
#          train.turntable_frames=0: no turntable video; training itself is the shipped config)
#   3DGS:  python3 -m bench.peers.run --method gsplat --steps $PEER_STEPS (default 7000), with the data.* overrides
#          of $CAPTURE_OVERRIDES for a capture (the same images and split as ours)
#   NeRF:  python3 -m bench.peers.run --method nerfacc --steps $NERFACC_STEPS (default 20000), same data
# and records them into $OUT/peers/<date>-<scene>.json and .png (copied beside session.tgz at the end).
# PEER_METHODS (default "gsplat"; "gsplat nerfacc" runs both) picks the peers; each one's CUDA code is built once
# first (nerfacc: JIT, needs nvcc on PATH, kept in build/torch_extensions like gsplat's).
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
export PATH="$CUDA_HOME/bin:$PATH"  # nerfacc's JIT build looks for nvcc on PATH
peer_methods=${PEER_METHODS:-gsplat}
peer_out="$OUT/peers" peer_date=$(date +%F)  # one date for every run of the stage: one results file per scene
mkdir -p "$peer_out"
case " $peer_methods " in *" gsplat "*)
  stage peers_gsplat_build env MAX_JOBS="${PEER_MAX_JOBS:-32}" python3 -c \
    "from gsplat.cuda._backend import _C; assert _C is not None, 'gsplat: no CUDA extension built'; print('gsplat built')"
  ;;
esac
case " $peer_methods " in *" nerfacc "*)
  stage peers_nerfacc_build env MAX_JOBS="${PEER_MAX_JOBS:-32}" python3 -c \
    "from nerfacc.cuda._backend import _C; assert _C is not None, 'nerfacc: no CUDA extension built'; print('nerfacc built')"
  ;;
esac
[ "${PEER_TESTS:-1}" = 1 ] && stage peers_tests python3 -m pytest -q -rs tests/test_peers.py tests/test_peers_gsplat.py tests/test_peers_nerfacc.py
# where a 3DGS step's time goes (~20 s): phases, top ops, SSIM and Adam A/B; PEER_PROFILE=0 skips it
if [ "${PEER_PROFILE:-1}" = 1 ] && [[ " $peer_methods " == *" gsplat "* ]]; then
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
  for method in $peer_methods; do
    case $method in gsplat) steps=${PEER_STEPS:-7000} ;; nerfacc) steps=${NERFACC_STEPS:-20000} ;; *)
      log "FAIL  peers: unknown method $method in PEER_METHODS (gsplat, nerfacc)"; failures=$((failures + 1)); continue ;;
    esac
    stage "peers_${scene}_$method" python3 -m bench.peers.run --scene "$scene" --data-root "$root" --method "$method" \
      --steps "$steps" --out "$peer_out" --date "$peer_date" "${peer_data[@]}"
  done
done
