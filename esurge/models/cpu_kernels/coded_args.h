// The arguments both coded kernels take (coded_matmul.cc in float32,
// coded_bf16_matmul.cc in bfloat16): x [M, K] with K a multiple of 32, codes
// [P, K, 16] (4 bits, two columns a byte) or [P, K, 32] (8 bits), scale and
// offset [P, K / 32, 32], y [M, N] with N filling the last panel (16 columns
// a panel with the fused SiLU gate, else 32).

#ifndef ESURGE_MODELS_CPU_KERNELS_CODED_ARGS_H_
#define ESURGE_MODELS_CPU_KERNELS_CODED_ARGS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace esurge_kernels {

constexpr int64_t kCodeBlock = 32;  // inputs per scale and offset

// Null when the dimensions fit the contract above, else what is wrong.
template <typename Dims>
const char* CodedArgsError(const Dims& xd, const Dims& cd, const Dims& sd, const Dims& od,
                           const Dims& yd, int64_t bits, bool silu_mul) {
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || od.size() != 3 || yd.size() != 2 ||
      (bits != 4 && bits != 8)) {
    return "expected x [M, K], codes [P, K, 16|32], scale/offset [P, K/32, 32], y [M, N], "
           "bits 4 or 8";
  }
  constexpr int64_t kPanelColumns = 32;
  const int64_t k = xd[1], panels = cd[0];
  const int64_t per_panel = silu_mul ? kPanelColumns / 2 : kPanelColumns;
  const bool match =
      k % kCodeBlock == 0 && cd[1] == k && cd[2] == (bits == 4 ? 16 : kPanelColumns) &&
      sd[0] == panels && sd[1] == k / kCodeBlock && sd[2] == kPanelColumns &&
      od[0] == sd[0] && od[1] == sd[1] && od[2] == sd[2] && yd[0] == xd[0] &&
      yd[1] <= panels * per_panel && yd[1] > (panels - 1) * per_panel;
  return match ? nullptr : "shapes do not match";
}

// The FFI signature every coded kernel's handler binds (x of dtype X, y of
// dtype Y), so the three handlers and cpu_kernels/__init__.py's calls agree.
template <xla::ffi::DataType X, xla::ffi::DataType Y>
auto CodedBinding() {
  namespace ffi = xla::ffi;
  // After x's dependent type every member template needs `template`.
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<X>>()                     // x
      .template Arg<ffi::Buffer<ffi::U8>>()      // codes
      .template Arg<ffi::Buffer<ffi::F32>>()     // scale
      .template Arg<ffi::Buffer<ffi::F32>>()     // offset
      .template Arg<ffi::Buffer<ffi::S32>>()     // num_rows
      .template Ret<ffi::Buffer<Y>>()            // y
      .template Attr<bool>("silu_mul")
      .template Attr<int64_t>("bits");
}

}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_CODED_ARGS_H_
