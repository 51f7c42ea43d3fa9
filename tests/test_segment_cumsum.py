"""models.render.exclusive_segment_cumsum: the per-ray prefix sums and their written-out gradient."""

import torch

from models.render import exclusive_segment_cumsum, segment_sum


def packed(counts: list[int], seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (N,) values and their (N,) ray ids for rays of ``counts`` samples each (zeros: empty rays)."""
    generator = torch.Generator().manual_seed(seed)
    ray = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.rand(ray.shape[0], generator=generator, dtype=dtype) * 2 - 0.5, ray


def per_ray(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: each ray's own exclusive cumsum, ray by ray (autograd through plain ops)."""
    return torch.cat([torch.cumsum(part, 0) - part for part in values.split(counts)])


def test_gradcheck_with_empty_rays_first_between_and_last():
    counts = [0, 3, 1, 0, 0, 5, 2, 0]  # empty rays where the first/last sample offsets are easiest to get wrong
    values, ray = packed(counts, seed=1)
    values.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: exclusive_segment_cumsum(v, ray, len(counts) + 2), (values,))


def test_values_and_gradient_match_a_per_ray_loop_float32():
    generator = torch.Generator().manual_seed(2)
    counts = torch.randint(0, 150, (2000,), generator=generator).tolist()
    values, ray = packed(counts, seed=3, dtype=torch.float32)
    weights = torch.randn(values.shape[0], generator=generator)
    got_values = values.clone().requires_grad_(True)
    got = exclusive_segment_cumsum(got_values, ray, len(counts))
    (got * weights).sum().backward()
    expected_values = values.double().requires_grad_(True)
    expected = per_ray(expected_values, counts)
    (expected * weights.double()).sum().backward()
    assert got.dtype == torch.float32 and got_values.grad.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got_values.grad.double(), expected_values.grad, rtol=1e-6, atol=1e-4)


def test_gradient_reaches_only_earlier_samples_of_the_same_ray():
    counts = [2, 3]
    values, ray = packed(counts, seed=4)
    values.requires_grad_(True)
    out = exclusive_segment_cumsum(values, ray, 2)
    (grad,) = torch.autograd.grad(out[4], values)  # the second ray's last sample: x2 + x3
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64))


def test_no_samples():  # both ops keep the graph on an empty batch
    values = torch.zeros(0, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    assert exclusive_segment_cumsum(values, empty, 4).shape == (0,)
    sums = segment_sum(values, empty, 4)
    assert sums.shape == (4,) and not sums.any() and sums.requires_grad


def test_segment_sum_values_and_gradient():
    counts = [0, 4, 1, 0, 7, 3, 0]
    values, ray = packed(counts, seed=5)
    values.requires_grad_(True)
    got = segment_sum(values, ray, len(counts) + 1)
    expected = torch.stack([part.sum() for part in values.detach().split(counts)] + [values.new_zeros(())])
    torch.testing.assert_close(got.detach(), expected)
    assert torch.autograd.gradcheck(lambda v: segment_sum(v, ray, len(counts) + 1), (values,))


def test_segment_sum_float32_large_batch():
    generator = torch.Generator().manual_seed(6)
    counts = torch.randint(0, 150, (2000,), generator=generator).tolist()
    values, ray = packed(counts, seed=7, dtype=torch.float32)
    got = segment_sum(values, ray, len(counts))
    expected = torch.zeros(len(counts), dtype=torch.float64).index_add(0, ray, values.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
