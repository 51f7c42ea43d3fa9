// sampled_tv on the CPU (tv.h): the cells' range checked first (so a bad call adds nothing), then one pass over
// the cells in order, each cell's C channels of its corner and three neighbours read and their gradients added.
// Serial: samples may share rows, and the estimate is ~1e6 multiply-adds (65536 cells of 12 channels).
#include <ATen/Dispatch.h>

#include "ops.h"
#include "tv.h"

namespace cuda_ext {

at::Tensor sampled_tv_cpu(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& cells,
                          at::IntArrayRef shape, at::IntArrayRef inside, double outside, double scale) {
  const TvLayout layout = check_sampled_tv_inputs(grad, values, cells, shape, inside, outside, scale, at::kCPU);
  const int64_t s_cells = cells.size(0), channels = values.size(1);
  const int64_t* cell = cells.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < s_cells; ++s) {
    TORCH_CHECK(cell[s] >= 0 && cell[s] < layout.cells, "sampled_tv: cells must lie in [0, ", layout.cells, "), got ",
                cell[s], " at position ", s);
  }
  double total = 0;
  if (s_cells > 0 && channels > 0) {
    const double k = scale / (static_cast<double>(s_cells) * static_cast<double>(channels));
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sampled_tv_cpu", [&] {
      const scalar_t* x = values.const_data_ptr<scalar_t>();
      scalar_t* g = grad.data_ptr<scalar_t>();
      const auto two_k = static_cast<scalar_t>(2 * k);
      for (int64_t s = 0; s < s_cells; ++s) {
        double weight[3];
        const int64_t row = layout.corner(cell[s], weight);
        for (int64_t c = 0; c < channels; ++c) {
          const int64_t at_corner = row * channels + c;
          scalar_t next[3], g_next[3];
          for (int a = 0; a < 3; ++a) next[a] = x[at_corner + layout.stride(a) * channels];
          total += static_cast<double>(tv_channel<scalar_t>(x[at_corner], next, weight, two_k, g_next));
          for (int a = 0; a < 3; ++a) {
            g[at_corner + layout.stride(a) * channels] += g_next[a];
            g[at_corner] -= g_next[a];
          }
        }
      }
    });
    total *= k;
  }
  return at::scalar_tensor(total, values.options().dtype(at::kDouble));
}

}  // namespace cuda_ext
