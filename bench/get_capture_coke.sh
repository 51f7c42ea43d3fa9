#!/bin/bash
# A second real development capture for issue 30 (never the held-out one): "coke", a handheld phone capture of a
# can on a table, 111 frames 540x960 JPEG posed by COLMAP through instant-ngp's colmap2nerf (OPENCV distortion
# k1 -0.106, aabb_scale 16), from the public repository akristoffersen/Scene2Mesh (no licence file: kept out of
# this repository, extracted locally for measurement only). Its train/val/test folders hold the same 111 images,
# so this writes one transforms.json over train/ and no split lists: the loader holds out every 8th frame.
#   fetch github:akristoffersen/Scene2Mesh, then: bench/get_capture_coke.sh GIT_DIR DEST
set -euo pipefail
GIT=${1:?usage: get_capture_coke.sh SCENE2MESH_GIT_DIR DEST}
DEST=${2:?usage: get_capture_coke.sh SCENE2MESH_GIT_DIR DEST}
mkdir -p "$DEST"
git --git-dir="$GIT" archive HEAD real_scene_data/coke/train real_scene_data/coke/transforms_train.json \
  | tar -x -C "$DEST" --strip-components=2
mv "$DEST/transforms_train.json" "$DEST/transforms.json"
python3 - "$DEST" <<'PY'
import json, os, sys
dest = sys.argv[1]
frames = json.load(open(f"{dest}/transforms.json"))["frames"]
missing = [f["file_path"] for f in frames if not os.path.exists(os.path.join(dest, f["file_path"]))]
print(f"coke: {len(frames)} frames, {len(missing)} missing images")
PY
