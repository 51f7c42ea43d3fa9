// Bilinear upsampling on the CPU. The per-axis taps (forward) and gather windows (backward) are
// tabulated once per call from UpsampleAxis (upsample.h); the loops over rows run in parallel.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "upsample.h"

namespace cuda_ext {
namespace {

constexpr int64_t kGrain = 16384;  // output elements per parallel task, roughly

// Rows per parallel task so that a task handles about kGrain elements.
int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_length)); }

template <typename scalar_t>
std::vector<LinearTaps<scalar_t>> tabulate_taps(const UpsampleAxis<scalar_t>& axis) {
  std::vector<LinearTaps<scalar_t>> taps(axis.out_size);
  for (int64_t o = 0; o < axis.out_size; ++o) taps[o] = axis.taps(o);
  return taps;
}

// For every input i of an axis: the first output of its window and the window's weights, stored in
// rows of `width` (the longest window; shorter windows are padded with zero weights, so the inner
// loops have a fixed trip count). Padding never reads past the outputs: begin is clamped for that.
template <typename scalar_t>
struct GatherTable {
  int64_t width = 0;
  std::vector<int64_t> begin;
  std::vector<scalar_t> weights;

  explicit GatherTable(const UpsampleAxis<scalar_t>& axis)
      : width(std::min(axis.max_window(), axis.out_size)), begin(axis.in_size), weights(axis.in_size * width, 0) {
    for (int64_t i = 0; i < axis.in_size; ++i) {
      const OutputRange r = axis.window(i);
      begin[i] = std::min(r.begin, axis.out_size - width);
      for (int64_t o = r.begin; o < r.end; ++o) weights[i * width + (o - begin[i])] = axis.weight(i, o);
    }
  }
};

}  // namespace

at::Tensor upsample_bilinear2d_cpu(const at::Tensor& x_in, int64_t scale_factor, bool align_corners) {
  check_upsample_input(x_in, scale_factor);
  const at::Tensor x = contiguous_on(x_in, "x", at::kCPU, "upsample_bilinear2d");
  if (scale_factor == 1) return x.clone();  // as F.interpolate: an exact copy
  const int64_t planes = x.size(0) * x.size(1), in_h = x.size(2), in_w = x.size(3);
  at::Tensor y = at::empty({x.size(0), x.size(1), in_h * scale_factor, in_w * scale_factor}, x.options());
  if (y.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "upsample_bilinear2d_cpu", [&] {
    const auto rows = UpsampleAxis<scalar_t>::make(in_h, scale_factor, align_corners);
    const auto cols = UpsampleAxis<scalar_t>::make(in_w, scale_factor, align_corners);
    const auto row_taps = tabulate_taps(rows);
    const auto col_taps = tabulate_taps(cols);
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = y.data_ptr<scalar_t>();
    const int64_t out_w = cols.out_size;
    at::parallel_for(0, planes * rows.out_size, row_grain(out_w), [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const int64_t plane = row / rows.out_size;
        const LinearTaps<scalar_t> th = row_taps[row % rows.out_size];
        const scalar_t* top = src + (plane * in_h + th.i0) * in_w;
        const scalar_t* bottom = src + (plane * in_h + th.i1) * in_w;
        scalar_t* out = dst + row * out_w;
        for (int64_t ow = 0; ow < out_w; ++ow) {
          const LinearTaps<scalar_t>& tw = col_taps[ow];
          out[ow] = th.l0 * (tw.l0 * top[tw.i0] + tw.l1 * top[tw.i1]) +
                    th.l1 * (tw.l0 * bottom[tw.i0] + tw.l1 * bottom[tw.i1]);
        }
      }
    });
  });
  return y;
}

at::Tensor upsample_bilinear2d_backward_cpu(const at::Tensor& grad_out_in, int64_t input_height, int64_t input_width,
                                            int64_t scale_factor, bool align_corners) {
  check_upsample_backward_input(grad_out_in, input_height, input_width, scale_factor);
  const at::Tensor grad_out = contiguous_on(grad_out_in, "grad_out", at::kCPU, "upsample_bilinear2d_backward");
  if (scale_factor == 1) return grad_out.clone();
  const int64_t planes = grad_out.size(0) * grad_out.size(1);
  at::Tensor grad_x = at::empty({grad_out.size(0), grad_out.size(1), input_height, input_width}, grad_out.options());
  if (grad_x.numel() == 0) return grad_x;
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "upsample_bilinear2d_backward_cpu", [&] {
    const GatherTable<scalar_t> rows(UpsampleAxis<scalar_t>::make(input_height, scale_factor, align_corners));
    const GatherTable<scalar_t> cols(UpsampleAxis<scalar_t>::make(input_width, scale_factor, align_corners));
    const int64_t out_h = input_height * scale_factor, out_w = input_width * scale_factor;
    const scalar_t* src = grad_out.const_data_ptr<scalar_t>();
    scalar_t* dst = grad_x.data_ptr<scalar_t>();
    at::parallel_for(0, planes * input_height, row_grain(input_width * rows.width * cols.width),
                     [&](int64_t first, int64_t last) {
                       std::vector<scalar_t> row_sum(input_width);  // this row's gather, one window row at a time
                       for (int64_t row = first; row < last; ++row) {
                         const int64_t plane = row / input_height, ih = row % input_height;
                         const scalar_t* wh = &rows.weights[ih * rows.width];
                         std::fill(row_sum.begin(), row_sum.end(), scalar_t(0));
                         for (int64_t j = 0; j < rows.width; ++j) {
                           const scalar_t* g = src + (plane * out_h + rows.begin[ih] + j) * out_w;
                           for (int64_t iw = 0; iw < input_width; ++iw) {
                             const scalar_t* ww = &cols.weights[iw * cols.width];
                             const scalar_t* gw = g + cols.begin[iw];
                             scalar_t acc = 0;
                             for (int64_t k = 0; k < cols.width; ++k) acc += ww[k] * gw[k];
                             row_sum[iw] += wh[j] * acc;
                           }
                         }
                         std::copy(row_sum.begin(), row_sum.end(), dst + row * input_width);
                       }
                     });
  });
  return grad_x;
}

}  // namespace cuda_ext
