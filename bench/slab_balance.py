"""How the space split's slabs would share a training step's samples (issue 33), read from a one-GPU run.

    python bench/slab_balance.py --out balance.json --at 1000,2000,2990 -- +experiment=blender data.root=PATH

Runs train.py in this process with the overrides after ``--`` and, before each step in ``--at``, marches
``--batches`` of the sampler's training batches through the model as it stands (the training march, with
gradients, never stepped) and counts its samples per cell layer of the grids' first axis: those marched, those alive
after early termination, and those shaded (the weight threshold's). A rank of ``train.parallel=space`` marches,
keeps and shades exactly those of its slab (models/space_split.py), so each kind's share per slab follows from the
histograms for any planes. For 2 and 4 ranks the JSON gives each kind's largest slab share (what the slowest rank
carries; 1 / ranks is even) for the planes cut evenly, at the occupancy's surface cells (session 40's rule) and at
the shaded samples' own quantiles (the cut by the samples alone: the best a cut of this axis can do for them).

Run it without ``model.capped_samples`` (the capped march files padding rows under the grid's centre). The batches
it marches are drawn from the training sampler, so the run trains on other batches after it.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models import render_views  # noqa: E402
from models.field import cell_index  # noqa: E402
from models.space_split import Slabs  # noqa: E402
from training import trainer  # noqa: E402

KINDS = ("march", "alive", "shown")


class LayerCounts:
    """Counts the (N, 3) grid points of the model's lookups per first-axis cell layer. Within one march the first
    density lookup is the marched samples', the last the alive ones' (one lookup when nothing is dropped), the
    features' the shaded ones'."""

    def __init__(self, model):
        self.model, self.cells = model, model.grid_shape[0] - 1
        self.counts = {kind: torch.zeros(self.cells, dtype=torch.float64) for kind in KINDS}

    def _layers(self, points: torch.Tensor) -> torch.Tensor:
        layer = cell_index(points[:, 0].detach(), self.cells + 1)
        return torch.bincount(layer.reshape(-1), minlength=self.cells).double().cpu()

    def march(self, origins: torch.Tensor, directions: torch.Tensor, jitter: torch.Tensor | bool) -> None:
        model, density, features = self.model, self.model.query_density, self.model.query_features
        looked_up: dict[str, list[torch.Tensor]] = {"density": [], "features": []}

        def query_density(points):
            looked_up["density"].append(self._layers(points))
            return density(points)

        def query_features(points):
            looked_up["features"].append(self._layers(points))
            return features(points)

        model.query_density, model.query_features = query_density, query_features
        try:
            render_views.march(model, origins, directions, jitter)
        finally:
            del model.query_density, model.query_features  # the class's methods again
        marched, *_, alive = looked_up["density"] * (2 if len(looked_up["density"]) == 1 else 1)
        for kind, layers in zip(KINDS, (marched, alive, looked_up["features"][0])):
            self.counts[kind] += layers


def surface_layers(occupied: torch.Tensor) -> torch.Tensor:
    """(R0 - 1,) count of the surface cells (occupied, with an empty neighbour of 26) in each first-axis cell layer of
    an (R0-1, R1-1, R2-1) occupancy mask: session 40's surface cut the slabs where these split
    evenly (the shaded samples lie near surfaces); lego shaded 57-58% on one slab there, so it went."""
    empty_near = torch.nn.functional.max_pool3d((~occupied).float()[None, None], 3, 1, 1)[0, 0] > 0
    return (occupied & empty_near).sum((1, 2))


def largest_share(layers: torch.Tensor, planes: tuple[int, ...]) -> float:
    """The largest share of ``layers``' sum that one slab of ``planes`` holds."""
    edges = [0, *planes, layers.numel()]
    parts = [float(layers[a:b].sum()) for a, b in zip(edges, edges[1:])]
    return max(parts) / max(sum(parts), 1e-30)


def shares(counts: dict[str, torch.Tensor], surface: torch.Tensor, ranks: int) -> dict:
    cells = surface.numel()
    cuts = {
        "even": Slabs.even(cells + 1, ranks, 0).planes,
        "surface": Slabs.balanced(surface, ranks, 0).planes,
        "shown": Slabs.balanced(counts["shown"], ranks, 0).planes,
    }
    return {
        name: {"planes": list(planes), **{kind: round(largest_share(counts[kind], planes), 4) for kind in KINDS}}
        for name, planes in cuts.items()
    }


def install(out: Path, steps: set[int], batches: int) -> None:
    plain_step = trainer.Trainer.train_step
    report: dict = {"batches": batches, "steps": {}}

    def train_step(self):
        if self.step in steps:
            model = self.model
            counter = LayerCounts(model)
            for _ in range(batches):
                batch = self.sampler.sample()
                jitter = True if batch.jitter is None else batch.jitter.reshape(-1)  # patches: their rays, flat
                counter.march(batch.origins.reshape(-1, 3), batch.directions.reshape(-1, 3), jitter)
            surface = surface_layers(model.occupancy.mask).cpu()
            per_batch = {kind: float(count.sum()) / batches for kind, count in counter.counts.items()}
            entry = {"grid": list(model.grid_shape), "per_batch": per_batch}
            entry |= {f"{ranks}_ranks": shares(counter.counts, surface, ranks) for ranks in (2, 4)}
            report["steps"][str(self.step)] = entry
            out.write_text(json.dumps(report, indent=1))
            print(f"slab balance at step {self.step}: {json.dumps(entry['2_ranks'])}", flush=True)
        return plain_step(self)

    trainer.Trainer.train_step = train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--at", default="1000,2000,2990", help="steps (0-based) before which to count")
    parser.add_argument("--batches", type=int, default=8, help="training batches marched at each")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args(argv)
    install(args.out, {int(step) for step in args.at.split(",")}, args.batches)
    sys.argv = [str(REPO / "train.py"), *args.overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
