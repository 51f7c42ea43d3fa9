"""cuda_ext.volume_render against its reference (float64), gradcheck, opcheck, the model's former compositing
code, early termination, poisoned outputs on CUDA, and bad input."""

from __future__ import annotations

import pytest
import torch
from test_padded_packs import past_the_end

import cuda_ext
from cuda_ext import reference
from models.render import accumulate, compositing_weights

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


def packed(counts: list[int], channels: int, dtype=torch.float64, device="cpu", seed: int = 0):
    """Random packed samples for rays with ``counts`` samples each (some empty): optical depth in (0, 0.6)."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(counts)
    sd = (torch.rand(n, generator=generator, dtype=torch.float64) * 0.6 + 1e-3).to(dtype)
    values = (torch.rand(n, channels, generator=generator, dtype=torch.float64) * 2 - 0.5).to(dtype)
    t = (torch.rand(n, generator=generator, dtype=torch.float64) * 4 + 2).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    return [x.to(device) for x in (sd, values, t, offsets)]


COUNTS = [5, 0, 1, 40, 3, 0, 77, 12]  # empty, single-sample, long (several warps' chunks) rays


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [1, 3, 12, 20])
@pytest.mark.parametrize("early_stop", [0.0, 0.2])
def test_matches_the_reference_in_float64(device, channels, early_stop):
    sd, values, t, offsets = packed(COUNTS, channels, device=device)
    got = cuda_ext.volume_render(sd, values, t, offsets, early_stop)
    want = reference.volume_render(sd, values, t, offsets, early_stop)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("early_stop", [0.0, 0.3])
def test_gradients_match_the_reference(device, early_stop):
    inputs = packed(COUNTS, 3, device=device, seed=1)
    grads = []
    for fn in (cuda_ext.volume_render, reference.volume_render):
        sd, values = (x.clone().requires_grad_() for x in inputs[:2])
        out, opacity, depth = fn(sd, values, inputs[2], inputs[3], early_stop)
        weights = torch.rand(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype).to(device)
        (out * weights).sum().add((opacity * 0.7).sum()).add((depth * -0.3).sum()).backward()
        grads.append((sd.grad, values.grad))
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("early_stop", [0.0, 0.4])
def test_gradcheck_cpu(early_stop):
    sd, values, t, offsets = packed([4, 0, 9, 2], 3, seed=3)
    sd.requires_grad_()
    values.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda s, v: cuda_ext.volume_render(s, v, t, offsets, early_stop), (sd, values), eps=1e-6, atol=1e-7
    )


@pytest.mark.requires_cuda
def test_gradcheck_cuda():
    sd, values, t, offsets = packed([4, 0, 35, 2], 3, device="cuda", seed=4)
    sd.requires_grad_()
    values.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda s, v: cuda_ext.volume_render(s, v, t, offsets), (sd, values), eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("device", DEVICES)
def test_float32_close_to_float64(device):
    sd, values, t, offsets = packed(COUNTS * 20, 12, device=device, seed=5)
    want = cuda_ext.volume_render(sd, values, t, offsets)
    got = cuda_ext.volume_render(sd.float(), values.float(), t.float(), offsets)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_matches_the_models_former_compositing_code():
    sd, values, t, offsets = packed(COUNTS, 6, seed=6)
    ray = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    weights = compositing_weights(sd, ray, len(COUNTS))
    out, opacity, depth = cuda_ext.volume_render(sd, values, t, offsets)
    torch.testing.assert_close(out, accumulate(values, weights, ray, len(COUNTS)))
    torch.testing.assert_close(opacity, accumulate(torch.ones_like(t)[:, None], weights, ray, len(COUNTS))[:, 0])
    torch.testing.assert_close(depth, accumulate(t[:, None], weights, ray, len(COUNTS))[:, 0])


def test_opcheck():
    sd, values, t, offsets = packed(COUNTS, 3, seed=7)
    torch.library.opcheck(
        torch.ops.cuda_ext.volume_render.default, (sd.requires_grad_(), values.requires_grad_(), t, offsets, 0.1)
    )


@pytest.mark.requires_cuda
def test_every_output_is_written_on_cuda(poison_cuda_cache):
    sd, values, t, offsets = packed(COUNTS * 50, 12, dtype=torch.float32, device="cuda", seed=8)
    sd.requires_grad_()
    values.requires_grad_()
    poison_cuda_cache()
    out, opacity, depth = cuda_ext.volume_render(sd, values, t, offsets, 0.05)
    poison_cuda_cache()
    (out.sum() + opacity.sum() + depth.sum()).backward()
    for tensor in (out, opacity, depth, sd.grad, values.grad):
        assert torch.isfinite(tensor).all()


@pytest.mark.requires_cuda
def test_samples_in_no_ray_get_zero_gradients_on_cuda(poison_cuda_cache):
    """Offsets that leave samples before the first ray or after the last one are invalid (the CPU op refuses
    them; CUDA does not check, that would be a host sync): the CUDA backward still writes zeros there, not
    whatever its output memory held, and the rays' own gradients equal the CPU kernel's on the same rays."""
    sd, values, t, offsets = packed(COUNTS * 20, 12, dtype=torch.float64, device="cuda", seed=9)
    inner = offsets.clone()
    inner[0], inner[-1] = 3, offsets[-1] - 4  # the first 3 and the last 4 samples are in no ray
    sd.requires_grad_()
    values.requires_grad_()
    out, opacity, depth = torch.ops.cuda_ext.volume_render(sd, values, t, inner, 0.0)
    poison_cuda_cache()
    (out.sum() + opacity.sum() + depth.sum()).backward()
    for grad in (sd.grad, values.grad):
        assert torch.equal(grad[:3], torch.zeros_like(grad[:3])) and torch.equal(grad[-4:], torch.zeros_like(grad[-4:]))
    n = sd.shape[0]
    cpu = [x.detach().cpu()[3 : n - 4].requires_grad_() for x in (sd, values)]
    cpu_out = cuda_ext.volume_render(cpu[0], cpu[1], t.cpu()[3 : n - 4], (inner - 3).cpu().clamp(max=n - 7), 0.0)
    (cpu_out[0].sum() + cpu_out[1].sum() + cpu_out[2].sum()).backward()
    torch.testing.assert_close(sd.grad[3 : n - 4].cpu(), cpu[0].grad)
    torch.testing.assert_close(values.grad[3 : n - 4].cpu(), cpu[1].grad)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "optical_depth": a["optical_depth"].float()}, TypeError, "values and optical_depth"),
        (lambda a: {**a, "values": a["values"][:, 0]}, ValueError, "values must have shape"),
        (lambda a: {**a, "t": a["t"][:-1]}, ValueError, "t must have shape"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"].int()}, TypeError, "ray_offsets must be int64"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"][:0]}, ValueError, "ray_offsets must have shape"),
        (lambda a: {**a, "early_stop": -0.1}, ValueError, "early_stop must be in"),
        (lambda a: {**a, "early_stop": "0"}, TypeError, "early_stop must be a number"),
        (lambda a: {**a, "optical_depth": a["optical_depth"].tolist()}, TypeError, "optical_depth must be a torch"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"] - 1}, ValueError, "ray_offsets must start at 0"),
        (lambda a: {**a, "ray_offsets": past_the_end(a["ray_offsets"])}, ValueError, "must end at most at N = 5"),
        (lambda a: {**a, "ray_offsets": torch.tensor([0, 4, 3, 5])}, ValueError, "ray_offsets must be non-decreasing"),
        (lambda a: {**a, "values": a["values"].to("meta")}, ValueError, "values and optical_depth must be on the same"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"].to("meta")}, ValueError, "ray_offsets and optical_depth"),
        (lambda a: {**a, "optical_depth": a["optical_depth"].half()}, TypeError, "optical_depth must be float32 or"),
    ],
)
@pytest.mark.parametrize("fn", [cuda_ext.volume_render, reference.volume_render])
def test_bad_input_names_the_argument(fn, change, error, match):
    sd, values, t, offsets = packed([3, 2], 3)
    args = change({"optical_depth": sd, "values": values, "t": t, "ray_offsets": offsets, "early_stop": 0.0})
    with pytest.raises(error, match=match):
        fn(**args)


def test_direct_op_call_with_bad_input_raises_not_crashes():
    sd, values, t, offsets = packed([3, 2], 3)
    with pytest.raises(RuntimeError, match="volume_render: t must have shape"):
        torch.ops.cuda_ext.volume_render(sd, values, t[:-1], offsets, 0.0)
    with pytest.raises(RuntimeError, match="volume_render: ray_offsets must end at most at N = 5"):
        torch.ops.cuda_ext.volume_render(sd, values, t, past_the_end(offsets), 0.0)
    out = torch.ops.cuda_ext.volume_render(sd, values, t, offsets, 0.0)
    with pytest.raises(RuntimeError, match="volume_render_backward: ray_offsets must be non-decreasing"):
        torch.ops.cuda_ext.volume_render_backward(*out, sd, values, t, torch.tensor([0, 6, 5]), *out, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_gradients_of_thin_samples_stay_accurate(device):
    """Tiny s: w_i = T_i (1 - exp(-s_i)) must come from expm1 in the backward too (T_i - T_{i+1} cancels)."""
    sd, values, t, offsets = packed([60] * 64, 3, device=device, seed=9)
    sd = sd * 1e-3
    grads = []
    for dtype in (torch.float64, torch.float32):
        s, v = (x.detach().to(dtype).requires_grad_() for x in (sd, values))
        out, opacity, depth = cuda_ext.volume_render(s, v, t.to(dtype), offsets)
        (out.sum() + opacity.sum() + depth.sum()).backward()
        grads.append((s.grad.double(), v.grad.double()))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fn", [cuda_ext.volume_render, reference.volume_render], ids=["op", "reference"])
def test_a_sample_at_infinity_makes_its_ray_opaque_not_brighter(device, dtype, fn):
    """A contracted march's last sample has a huge optical depth (its step grows with the distance squared: s ~ 1e11
    on a capture). Its T must still be the ray's own (not 1 from a prefix cancelled against it), on every ray of a
    long batch (a global prefix sum over many such rays runs past float64's exact range)."""
    rays, count = 3000, 40  # the huge sample is lane 7 of each ray's second warp chunk
    sd, values, t, offsets = packed([count] * rays, 3, device=device, seed=11)
    sd = (sd * 0.05).reshape(rays, count)
    sd[:, -1] = 1e13
    sd = sd.reshape(-1)
    per_ray = sd.reshape(rays, count)  # the per-ray answer in float64: T_i from each ray's own prefix sum
    before = torch.cat([torch.zeros_like(per_ray[:, :1]), per_ray[:, :-1].cumsum(1)], 1)  # not cumsum - s: it cancels
    transmittance = torch.exp(-before)
    weights = transmittance * -torch.expm1(-per_ray)
    want_colour = (weights[..., None] * values.reshape(rays, count, 3)).sum(1)
    colour, opacity, depth = fn(sd.to(dtype), values.to(dtype), t.to(dtype), offsets)
    tolerance = (
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    )  # the reference's global float64 sum
    torch.testing.assert_close(opacity.double(), weights.sum(1), **tolerance)  # 1: opaque
    torch.testing.assert_close(colour.double(), want_colour, **tolerance)
    torch.testing.assert_close(
        compositing_weights(sd.to(dtype), torch.arange(rays, device=device).repeat_interleave(count), rays).double(),
        weights.reshape(-1),
        **tolerance,
    )
