// CUDA_EXT_GRID_REORDER: in which order the CUDA grid forward visits its points
// (cuda/grid_interpolate_buckets.cuh). Host code of the grid lookup, read by both backends' entry points.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace cuda_ext {

// "auto" (the default: in axis-0 bucket order where that can pay), "off" (as given), "always" (in bucket
// order whenever the dtype allows, even for small inputs: for tests).
enum class ReorderMode { kAuto, kOff, kAlways };

// Read at every lookup; a bad value is an error on both backends, so a typo never passes silently on one.
// The CPU kernel ignores the mode.
inline ReorderMode reorder_mode(const char* op) {
  const char* value = std::getenv("CUDA_EXT_GRID_REORDER");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return ReorderMode::kAuto;
  if (std::strcmp(value, "off") == 0) return ReorderMode::kOff;
  if (std::strcmp(value, "always") == 0) return ReorderMode::kAlways;
  TORCH_CHECK(false, op, ": the environment variable CUDA_EXT_GRID_REORDER must be auto, off or always, got '", value,
              "'");
}

}  // namespace cuda_ext
