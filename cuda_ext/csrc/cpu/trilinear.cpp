// CPU kernels of the pairwise op trilinear_interpolate ((N, 8, F) corners at (N, 3) points), forward and
// backward. float32/float64, 64-bit indexing, at::parallel_for over points.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "trilinear.h"

namespace cuda_ext {
namespace {

template <typename scalar_t>
void pair_weights(const scalar_t* point, scalar_t w[8]) {
  pair_corner_weights(local_fraction(point[0]), local_fraction(point[1]), local_fraction(point[2]), w);
}

template <typename scalar_t>
void pair_forward(const scalar_t* feats, const scalar_t* points, scalar_t* out, int64_t n_points, int64_t f) {
  at::parallel_for(0, n_points, grain_for(9 * f), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t w[8];
      pair_weights(points + 3 * n, w);
      const scalar_t* c = feats + n * 8 * f;
      scalar_t* o = out + n * f;
      for (int64_t j = 0; j < f; ++j) {
        o[j] = w[0] * c[j] + w[1] * c[f + j] + w[2] * c[2 * f + j] + w[3] * c[3 * f + j] + w[4] * c[4 * f + j] +
               w[5] * c[5 * f + j] + w[6] * c[6 * f + j] + w[7] * c[7 * f + j];
      }
    }
  });
}

// grad_feats[n,k,:] = w_k * grad_out[n,:]; grad_points from the 8 dots <grad_out, feats[n,k]>.
// Either output pointer may be null (gradient not requested).
template <typename scalar_t>
void pair_backward(const scalar_t* grad_out, const scalar_t* feats, const scalar_t* points, scalar_t* grad_feats,
                   scalar_t* grad_points, int64_t n_points, int64_t f) {
  at::parallel_for(0, n_points, grain_for(17 * f), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* g = grad_out + n * f;
      const scalar_t* p = points + 3 * n;
      scalar_t w[8];
      pair_weights(p, w);
      if (grad_feats) {
        scalar_t* gf = grad_feats + n * 8 * f;
        for (int k = 0; k < 8; ++k) {
          for (int64_t j = 0; j < f; ++j) gf[k * f + j] = w[k] * g[j];
        }
      }
      if (grad_points) {
        const scalar_t* c = feats + n * 8 * f;
        scalar_t dots[8];
        for (int k = 0; k < 8; ++k) {
          scalar_t acc = 0;
          for (int64_t j = 0; j < f; ++j) acc += g[j] * c[k * f + j];
          dots[k] = acc;
        }
        scalar_t grad[3];
        pair_fraction_grads(local_fraction(p[0]), local_fraction(p[1]), local_fraction(p[2]), dots, grad);
        for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = grad[a] / scalar_t(2);  // du/dx = 1/2
      }
    }
  });
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor trilinear_interpolate_cpu(const at::Tensor& feats_in, const at::Tensor& points_in) {
  check_pair_inputs(feats_in, points_in, at::kCPU, "trilinear_interpolate");
  const at::Tensor feats = feats_in.contiguous(), points = points_in.contiguous();
  const int64_t n = feats.size(0), f = feats.size(2);
  at::Tensor out = at::empty({n, f}, feats.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "trilinear_interpolate_cpu", [&] {
    pair_forward(feats.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, f);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cpu(const at::Tensor& grad_out_in,
                                                                      const at::Tensor& feats_in,
                                                                      const at::Tensor& points_in,
                                                                      bool feats_requires_grad,
                                                                      bool points_requires_grad) {
  const char* op = "trilinear_interpolate_backward";
  check_pair_inputs(feats_in, points_in, at::kCPU, op);
  const int64_t n = feats_in.size(0), f = feats_in.size(2);
  check_grad_out(grad_out_in, n, f, feats_in, "feats", op);
  const at::Tensor grad_out = grad_out_in.contiguous(), feats = feats_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_feats = feats_requires_grad ? at::empty({n, 8, f}, feats.options()) : no_grad_placeholder(feats);
  // zeros: with F == 0 no kernel runs and the gradient is exactly 0.
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (n == 0 || f == 0 || !(feats_requires_grad || points_requires_grad)) return {grad_feats, grad_points};
  AT_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "trilinear_interpolate_backward_cpu", [&] {
    pair_backward(grad_out.data_ptr<scalar_t>(), feats.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(),
                  feats_requires_grad ? grad_feats.data_ptr<scalar_t>() : nullptr,
                  points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr, n, f);
  });
  return {grad_feats, grad_points};
}

}  // namespace cuda_ext
