"""Per-image appearance: what differs between the photos of a real capture but not in the scene (exposure, white
balance, vignetting drift), learnt per training image so the field does not paint it into the geometry as floaters.

Two forms (``model.appearance``), both owned by the decoder (models/decoder.py), so their parameters are the
decoder's (learning rate ``train.lr_decoder``, saved in the checkpoint's state dict, restored on resume):

- ``embedding`` (NeRF-W / nerfacto): a learnt (num_images, D) code per training image, fed to the shading MLP
  beside its other inputs. Starts at zero.
- ``affine``: a learnt colour transform per image, ``A c + b`` with A (3, 3) and b (3,), applied to the
  premultiplied per-pixel colour as ``A c + opacity * b``: since compositing is linear, the same as transforming
  every sample, at a per-ray cost (per sample, the table's backward scatter-added millions of rows onto a few
  dozen: 27% of a capture step on an H100). Starts at the identity. Cheaper than the embedding (no MLP inputs)
  and cannot learn anything but colour.

Rule for images without a code (held-out frames, renders, the viewer: ``image_index`` None): the mean of the
training images' codes / transforms. The mean, not zero or the identity: the field and the per-image codes can
drift together (every transform doubling while the colours halve), and only their mean appearance is pinned by
the data. An index outside [0, num_images) is an error.

The table's number of images is set by :meth:`Appearance.resize` (the trainer: the training split's views); a
model built without it (export, render_path) takes the checkpoint's shape when the state dict is loaded.
"""

from __future__ import annotations

import torch
import torch.nn as nn

APPEARANCE_MODES = ("none", "embedding", "affine")
_AFFINE = 12  # a (3, 4) matrix [A | b] per image


class Appearance(nn.Module):
    """Per-image appearance codes (see the module docstring).

    Args:
        mode: ``none``, ``embedding`` or ``affine``.
        dim: D, the embedding's width (``embedding`` only).
        num_images: rows of the table (0 until :meth:`resize` or a state dict sets them).
    """

    def __init__(self, mode: str = "none", dim: int = 16, num_images: int = 0):
        super().__init__()
        if mode not in APPEARANCE_MODES:
            raise ValueError(f"model.appearance: expected one of {', '.join(APPEARANCE_MODES)}, got {mode!r}")
        if mode == "embedding" and dim < 1:
            raise ValueError(f"model.appearance_dim: must be >= 1 with model.appearance=embedding, got {dim}")
        self.mode = mode
        self.width = {"none": 0, "embedding": dim, "affine": _AFFINE}[mode]
        self.table = nn.Parameter(torch.empty(0, self.width)) if mode != "none" else None
        self.resize(num_images)

    @property
    def embedding_dim(self) -> int:
        """Extra inputs the shading MLP takes (D for ``embedding``, else 0)."""
        return self.width if self.mode == "embedding" else 0

    @property
    def num_images(self) -> int:
        return 0 if self.table is None else self.table.shape[0]

    def resize(self, num_images: int) -> None:
        """A fresh table of ``num_images`` rows: zero codes, or identity transforms (replaces the parameter)."""
        if num_images < 0:
            raise ValueError(f"Appearance.resize: num_images must be >= 0, got {num_images}")
        if self.table is None:
            return
        device = self.table.device
        if self.mode == "embedding":
            rows = torch.zeros(num_images, self.width, device=device)
        else:
            rows = torch.eye(3, 4, device=device).reshape(1, _AFFINE).repeat(num_images, 1)
        self.table = nn.Parameter(rows)

    def _rows(self, image_index: torch.Tensor | None, count: int) -> torch.Tensor:
        """(count, width) rows for (count,) int64 image indices, or the table's mean for every row when None."""
        if image_index is None:
            mean = self.table.mean(0) if self.num_images else self._neutral()
            return mean.expand(count, self.width)
        if image_index.shape != (count,) or image_index.dtype != torch.int64:
            raise ValueError(
                f"image_index: expected ({count},) int64 image indices, got {tuple(image_index.shape)} "
                f"{image_index.dtype}"
            )
        return self.table[image_index]  # an index out of range raises here (IndexError / device assert)

    def _neutral(self) -> torch.Tensor:
        """The code of an untrained table: zeros, or the identity transform."""
        if self.mode == "embedding":
            return self.table.new_zeros(self.width)
        return torch.eye(3, 4, device=self.table.device).reshape(_AFFINE)

    def codes(self, image_index: torch.Tensor | None, count: int) -> torch.Tensor | None:
        """(count, D) embedding rows for the MLP's input, or None when the mode adds no inputs."""
        return self._rows(image_index, count) if self.mode == "embedding" else None

    def transform(
        self, colour: torch.Tensor, image_index: torch.Tensor | None, coverage: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(M, 3) colours -> (M, 3) after each one's image transform ``A c + coverage * b`` (``affine``; else
        unchanged). ``coverage``: (M,) opacities of premultiplied colours (None: 1)."""
        if self.mode != "affine":
            return colour
        matrix = self._rows(image_index, colour.shape[0]).reshape(-1, 3, 4)
        bias = matrix[:, :, 3] if coverage is None else matrix[:, :, 3] * coverage[:, None]
        # elementwise, not a batched matmul: M tiny 3x3 products are memory-bound either way
        return (matrix[:, :, :3] * colour[:, None, :]).sum(-1) + bias

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # a checkpoint's table decides the number of images (a model built for export has none yet)
        incoming = state_dict.get(prefix + "table")
        if self.table is not None and isinstance(incoming, torch.Tensor) and incoming.dim() == 2:
            if incoming.shape[1] == self.width and incoming.shape[0] != self.num_images:
                self.resize(incoming.shape[0])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


__all__ = ["APPEARANCE_MODES", "Appearance"]
