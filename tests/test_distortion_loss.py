"""cuda_ext.distortion_loss (mip-NeRF 360's distortion loss on volume_render's weights): the kernels and the
reference against per-ray loops over the definition in float64, against each other in float32, gradcheck, opcheck,
poisoned outputs on CUDA, and bad input."""

from __future__ import annotations

import pytest
import torch
from test_padded_packs import past_the_end

import cuda_ext
from cuda_ext import reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
FNS = [cuda_ext.distortion_loss, reference.distortion_loss]
COUNTS = [5, 0, 1, 40, 3, 0, 77, 12]  # empty, single-sample and long (several warps' chunks) rays


def packed(counts: list[int], dtype=torch.float64, device="cpu", seed: int = 0, depth: float = 0.6):
    """Random packed samples of rays with ``counts`` samples each: optical depths in (0, depth), per ray intervals
    in order with random lengths and gaps (empty-space skipping), (B + 1,) offsets."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(counts)
    rand = lambda *shape: torch.rand(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    sd = rand(n) * depth + 1e-3
    lengths, gaps = rand(n) * 0.05 + 1e-3, rand(n) * 0.3
    ray = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ends = torch.cat([torch.cumsum((lengths + gaps)[ray == r], 0) for r in range(len(counts))]) + 2.0
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    return [x.to(device) for x in (sd.to(dtype), (ends - lengths).to(dtype), ends.to(dtype), offsets)]


def definition(sd, t0, t1, offsets) -> torch.Tensor:
    """Per ray, the double sum as written: w_i = T_i (1 - exp(-s_i)) from a running product of exp(-s), then
    sum_ij w_i w_j |m_i - m_j| + 1/3 sum_i w_i^2 (t1_i - t0_i), all in float64."""
    sd, t0, t1 = (x.detach().cpu().double() for x in (sd, t0, t1))
    offsets = offsets.cpu()
    out = []
    for b in range(offsets.shape[0] - 1):
        first, last = int(offsets[b]), int(offsets[b + 1])
        transmittance, weights = 1.0, []
        for i in range(first, last):
            weights.append(transmittance * (1.0 - torch.exp(-sd[i])))
            transmittance = transmittance * torch.exp(-sd[i])
        mid = [(t0[i] + t1[i]) / 2 for i in range(first, last)]
        pairs = sum(wi * wj * abs(mi - mj) for wi, mi in zip(weights, mid) for wj, mj in zip(weights, mid))
        own = sum(w * w * (t1[i] - t0[i]) / 3 for w, i in zip(weights, range(first, last)))
        out.append(float(pairs + own))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FNS)
def test_matches_the_definition_in_float64(device, fn):
    sd, t0, t1, offsets = packed(COUNTS, device=device)
    got = fn(sd, t0, t1, offsets)
    want = definition(sd, t0, t1, offsets)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-14)
    assert got[1] == 0 and got[5] == 0 and bool((want[[0, 3, 6]] > 1e-3).all())  # empty rays exactly zero


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_the_reference(device):
    inputs = packed(COUNTS * 3, device=device, seed=1)
    scale = torch.rand(len(COUNTS) * 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    grads = []
    for fn in FNS:
        sd = inputs[0].clone().requires_grad_()
        (fn(sd, *inputs[1:]) * scale).sum().backward()
        grads.append(sd.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
    assert grads[0].abs().min() > 0  # every sample of a ray with weight gets a gradient


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    sd, t0, t1, offsets = packed([4, 0, 9, 1, 35], device=device, seed=3, depth=2.0)
    sd.requires_grad_()
    assert torch.autograd.gradcheck(lambda s: cuda_ext.distortion_loss(s, t0, t1, offsets), (sd,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("far", [0.0, 1e4])
def test_float32_close_to_float64(device, far):
    """Also far along the rays (t + 1e4), where midpoints and sums of w m in float32 would round the intervals
    away unless measured from each ray's first sample."""
    sd, t0, t1, offsets = packed([300, 2, 500, 64], device=device, seed=4, depth=0.05)
    lowered = [sd.float(), (t0 + far).float(), (t1 + far).float()]
    want = definition(*lowered, offsets)  # the same float32 inputs, in float64
    for fn in FNS:
        torch.testing.assert_close(fn(*lowered, offsets).double().cpu(), want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("fn", FNS)
def test_a_surface_costs_less_than_two_blobs(fn):
    """The same opacity on one ray: two adjacent samples (a surface) cost less than the first and last sample
    (a floater in front of the surface); the values are the formula's."""
    t0 = torch.tensor([2.0, 2.1, 2.2, 4.0], dtype=torch.float64)
    offsets = torch.tensor([0, 4])

    def depths(weights: list[float]) -> torch.Tensor:  # the optical depths that give these weights
        out, transmittance = [], 1.0
        for w in weights:
            out.append(-torch.log1p(torch.tensor(-w / transmittance, dtype=torch.float64)))
            transmittance -= w
        return torch.stack(out)

    surface = fn(depths([0.0, 0.45, 0.45, 0.0]), t0, t0 + 0.1, offsets)
    floater = fn(depths([0.45, 0.0, 0.0, 0.45]), t0, t0 + 0.1, offsets)
    # 2 * 0.45^2 * 0.1 + 2 * 0.45^2 * 0.1 / 3, and 2 * 0.45^2 * 1.9 + the same own terms
    assert surface.item() == pytest.approx(0.054) and floater.item() == pytest.approx(0.8235)


@pytest.mark.parametrize("device", DEVICES)
def test_a_sample_at_infinity_keeps_the_loss_finite(device):
    """A contracted march's last sample has s ~ 1e11: its weight is the light left, not more."""
    sd, t0, t1, offsets = packed([6, 40], device=device, seed=5)
    sd[[5, -1]] = 1e11
    for fn in FNS:
        got = fn(sd.clone().requires_grad_(), t0, t1, offsets)
        torch.testing.assert_close(got.cpu(), definition(sd, t0, t1, offsets), rtol=1e-12, atol=1e-14)


def test_opcheck():
    sd, t0, t1, offsets = packed(COUNTS, seed=7)
    torch.library.opcheck(torch.ops.cuda_ext.distortion_loss.default, (sd.requires_grad_(), t0, t1, offsets))


@pytest.mark.requires_cuda
def test_every_output_is_written_on_cuda(poison_cuda_cache):
    sd, t0, t1, offsets = packed(COUNTS * 50, dtype=torch.float32, device="cuda", seed=8)
    sd.requires_grad_()
    poison_cuda_cache()
    loss = cuda_ext.distortion_loss(sd, t0, t1, offsets)
    poison_cuda_cache()
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(sd.grad).all()


@pytest.mark.requires_cuda
def test_samples_in_no_ray_get_zero_gradients_on_cuda(poison_cuda_cache):
    """Offsets that leave samples outside every ray are invalid (the CPU op refuses them; CUDA does not check,
    that would be a host sync): the CUDA backward writes zeros there, and the rays' own gradients equal the CPU
    kernel's."""
    sd, t0, t1, offsets = packed(COUNTS * 20, device="cuda", seed=9)
    inner = offsets.clone()
    inner[0], inner[-1] = 3, offsets[-1] - 4  # the first 3 and the last 4 samples are in no ray
    grad = torch.rand(offsets.shape[0] - 1, dtype=torch.float64, device="cuda")
    poison_cuda_cache()
    got = torch.ops.cuda_ext.distortion_loss_backward(grad, sd, t0, t1, inner)
    assert torch.equal(got[:3], torch.zeros_like(got[:3])) and torch.equal(got[-4:], torch.zeros_like(got[-4:]))
    n = sd.shape[0]
    cpu = [x.cpu()[3 : n - 4] for x in (sd, t0, t1)]
    want = torch.ops.cuda_ext.distortion_loss_backward(grad.cpu(), *cpu, (inner - 3).cpu().clamp(max=n - 7))
    torch.testing.assert_close(got[3 : n - 4].cpu(), want)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "optical_depth": a["optical_depth"].float()}, TypeError, "t_start and optical_depth"),
        (lambda a: {**a, "t_start": a["t_start"][:-1]}, ValueError, "t_start must have shape"),
        (lambda a: {**a, "t_end": a["t_end"][:, None]}, ValueError, "t_end must have shape"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"].int()}, TypeError, "ray_offsets must be int64"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"] - 1}, ValueError, "ray_offsets must start at 0"),
        (lambda a: {**a, "ray_offsets": past_the_end(a["ray_offsets"])}, ValueError, "must end at most at N = 5"),
        (lambda a: {**a, "ray_offsets": torch.tensor([0, 4, 3, 5])}, ValueError, "ray_offsets must be non-decreasing"),
        (lambda a: {**a, "t_end": a["t_end"].to("meta")}, ValueError, "t_end and optical_depth must be on the same"),
        (lambda a: {**a, "optical_depth": a["optical_depth"].half()}, TypeError, "optical_depth must be float32 or"),
        (lambda a: {**a, "t_start": a["t_start"].tolist()}, TypeError, "t_start must be a torch"),
        (lambda a: {**a, "t_end": a["t_end"].clone().requires_grad_()}, ValueError, "t_start and t_end are not"),
    ],
)
@pytest.mark.parametrize("fn", FNS)
def test_bad_input_names_the_argument(fn, change, error, match):
    sd, t0, t1, offsets = packed([3, 2])
    args = change({"optical_depth": sd, "t_start": t0, "t_end": t1, "ray_offsets": offsets})
    with pytest.raises(error, match=match):
        fn(**args)


def test_direct_op_call_with_bad_input_raises_not_crashes():
    sd, t0, t1, offsets = packed([3, 2])
    with pytest.raises(RuntimeError, match="distortion_loss: t_end must have shape"):
        torch.ops.cuda_ext.distortion_loss(sd, t0, t1[:-1], offsets)
    with pytest.raises(RuntimeError, match="distortion_loss: ray_offsets must end at most at N = 5"):
        torch.ops.cuda_ext.distortion_loss(sd, t0, t1, past_the_end(offsets))
    with pytest.raises(RuntimeError, match="distortion_loss_backward: grad must have shape"):
        torch.ops.cuda_ext.distortion_loss_backward(torch.ones(3, dtype=sd.dtype), sd, t0, t1, offsets)
