#!/bin/bash
# A second real development capture for issue 30 (never the held-out one): "coke", a handheld phone capture of a
# can on a table, 111 frames 540x960 JPEG posed by COLMAP through instant-ngp's colmap2nerf (OPENCV distortion
# k1 -0.106, aabb_scale 16), from the public repository akristoffersen/Scene2Mesh (no licence file: kept out of
# this repository, extracted locally for measurement only). Its train/val/test folders hold the same 111 images,
# so this writes one transforms.json over train/ and no split lists: the loader holds out every 8th frame.
#   fetch github:akristoffersen/Scene2Mesh, then: bench/get_capture_coke.sh GIT_DIR DEST [FRAMES]
# FRAMES (e.g. 67, as many as issue 30's held-out capture; "coke67" in bench/README) keeps that many frames spread
# evenly over the sorted 111 and writes aabb_scale 4: a sparser capture of the same scene (58 train / 9 held out).
set -euo pipefail
GIT=${1:?usage: get_capture_coke.sh SCENE2MESH_GIT_DIR DEST}
DEST=${2:?usage: get_capture_coke.sh SCENE2MESH_GIT_DIR DEST}
FRAMES=${3:-}
mkdir -p "$DEST"
git --git-dir="$GIT" archive HEAD real_scene_data/coke/train real_scene_data/coke/transforms_train.json \
  | tar -x -C "$DEST" --strip-components=2
mv "$DEST/transforms_train.json" "$DEST/transforms.json"
python3 - "$DEST" "$FRAMES" <<'PY'
import json, os, sys
dest, keep = sys.argv[1], sys.argv[2]
meta = json.load(open(f"{dest}/transforms.json"))
if keep:  # every (111 / FRAMES)-th frame by file name; the images of the others are deleted
    frames = sorted(meta["frames"], key=lambda frame: frame["file_path"])
    kept = [frames[i * len(frames) // int(keep)] for i in range(int(keep))]
    for frame in frames:
        if frame not in kept:
            os.remove(os.path.join(dest, frame["file_path"]))
    meta["frames"], meta["aabb_scale"] = kept, 4
    json.dump(meta, open(f"{dest}/transforms.json", "w"), indent=1)
frames = meta["frames"]
missing = [f["file_path"] for f in frames if not os.path.exists(os.path.join(dest, f["file_path"]))]
print(f"coke: {len(frames)} frames, {len(missing)} missing images")
PY
