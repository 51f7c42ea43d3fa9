"""training.sharded_adam: ShardedGridAdam on two gloo ranks is one process's torch.optim.Adam (each rank steps its slice
of the grid rows) and checkpoints the whole state, which resumes in one process."""

from __future__ import annotations

import copy

import pytest
import torch

from training.distributed import Group


def _gradients(step: int, rank: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Random gradients of one rank at one step, some grid rows (voxels) untouched, as a batch leaves them."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    for grad in grads[:2]:
        rows = grad.view(-1, grad.shape[-1])
        rows[torch.rand(rows.shape[0], generator=generator) < 0.5] = 0.0
    return grads


def _sharded_adam_against_adam(rank: int, world: int, init_file: str, results: str) -> None:
    import torch.distributed as dist

    from training.sharded_adam import ShardedGridAdam

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        shapes = [(3, 5, 7, 1), (3, 5, 7, 4), (6, 2)]  # 105 voxels: 52 per rank and a tail voxel both ranks step
        start = [torch.randn(shape, generator=torch.Generator().manual_seed(7 + i)) for i, shape in enumerate(shapes)]

        def groups(params):
            return [
                {"params": params[:2], "lr": 0.1, "name": "grids", "initial_lr": 0.1},
                {"params": params[2:], "lr": 0.01, "name": "decoder", "initial_lr": 0.01},
            ]

        sharded = [torch.nn.Parameter(t.clone()) for t in start]
        reference = [torch.nn.Parameter(t.clone()) for t in start]
        group = Group(rank, world, rank)
        optimizer = ShardedGridAdam(groups(sharded), group, betas=(0.9, 0.99), eps=1e-8, fused=False)
        adam = torch.optim.Adam(groups(reference), betas=(0.9, 0.99), eps=1e-8)
        for step in range(5):
            if step == 3:  # the trainer's schedule sets the rates on param_groups
                for g in (*optimizer.param_groups, *adam.param_groups):
                    g["lr"] *= 0.5
            optimizer.zero_grad(set_to_none=True)
            for parameter, grad in zip(sharded, _gradients(step, rank, shapes)):
                parameter.grad = grad
            group.average_gradients(sharded[2:])  # what Group.average_model_gradients(mode="sharded") does
            optimizer.step()
            every_rank = [_gradients(step, r, shapes) for r in range(world)]
            for index, parameter in enumerate(reference):  # one process: the batch's mean gradient
                parameter.grad = sum(grads[index] for grads in every_rank) / world
            adam.step()
        after_five = [p.detach().clone() for p in (*sharded, *reference)]
        adam_five = copy.deepcopy(adam.state_dict())
        optimizer.gather()
        saved = optimizer.state_dict() if rank == 0 else None
        # a fresh sharded optimiser resumes from one process's checkpoint: one more step on both
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in reference]
        again = ShardedGridAdam(groups(resumed), group, betas=(0.9, 0.99), eps=1e-8, fused=False)
        again.load_state_dict(adam.state_dict())
        for parameter, grad in zip(resumed, _gradients(9, rank, shapes)):
            parameter.grad = grad
        group.average_gradients(resumed[2:])
        again.step()
        every_rank = [_gradients(9, r, shapes) for r in range(world)]
        for index, parameter in enumerate(reference):
            parameter.grad = sum(grads[index] for grads in every_rank) / world
        adam.step()
        torch.save(
            {"five": after_five, "adam_five": adam_five, "saved": saved, "resumed": resumed, "reference": reference},
            f"{results}.{rank}",
        )
        dist.barrier()  # both ranks are done before either tears gloo down (one leaving first aborted the other once)
    finally:
        dist.destroy_process_group()


def test_sharded_adam_on_two_ranks_is_one_process_adam_and_checkpoints_whole(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_sharded_adam_against_adam, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        five = result["five"]  # 5 steps: the sharded parameters, then one process's
        for index in range(3):
            assert not torch.equal(five[index], five[index + 3] * 0), "nothing to compare"
            torch.testing.assert_close(five[index], five[index + 3], rtol=1e-5, atol=1e-6, msg=f"parameter {index}")
        for index, (mine, expected) in enumerate(zip(result["resumed"], result["reference"])):
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6, msg=f"resumed parameter {index}")
    # rank 0's checkpoint state: one process's Adam state dict over the whole parameters
    result = torch.load(tmp_path / "out.0", weights_only=False)
    saved, expected = result["saved"], result["adam_five"]
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert [g["lr"] for g in saved["param_groups"]] == pytest.approx([0.05, 0.005])
    assert set(saved["state"]) == set(expected["state"]) == {0, 1, 2}
    for index, entry in expected["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(saved["state"][index][key], entry[key], rtol=1e-5, atol=1e-7, msg=key)
