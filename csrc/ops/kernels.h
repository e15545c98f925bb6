#pragma once
// The kernel table: what each device provides under the op implementations in ops/. The op implementations
// check inputs, allocate outputs and finish results once, for every device; kernels_for(tensor) hands the work to
// the CPU table (cpu/, vectorised once per CPU capability) or the CUDA table (cuda/).
// Kernels trust their inputs: the ops check them first. B, L, D > 0 unless a line says otherwise.
#include <ATen/core/Tensor.h>

#include <string>

#include "common/row_selection.h"

namespace lmk_ops {

// The rows attention pooling reads and writes. Padded: listed.mask is the valid mask [B, L] (undefined: every row),
// valid the same, text_of_row undefined. Packed (hidden a [B, T, D] view with batch stride 0, common/packed.h):
// listed.positions lists each text's valid rows as absolute rows, valid marks the valid rows [T] (undefined: all),
// text_of_row [T] (int64) names each row's text, and the per-row tensors (weights [H, T], grad_weights [H, T],
// grad_hidden [T, D]) have no batch dimension.
struct AttentionRows {
  RowSelection listed;
  at::Tensor valid;
  at::Tensor text_of_row;

  bool packed() const {
    return text_of_row.defined();
  }
};

struct Kernels {
  // Checks that every value of int64 values [rows, cols] (contiguous) lies in [lo, hi]. Else: "<expected>, got V at
  // [r, c]" (with landmarks: "<expected>, got V in row r (landmarks[r, c])") for the first value outside, raised at
  // once on the CPU, and on CUDA printed by a device-side assertion, without synchronising.
  void (*check_range)(const at::Tensor& values, int64_t lo, int64_t hi, const std::string& expected, bool landmarks);
  // hidden [B, L, D] with any strides; out [B, D] contiguous, in hidden's dtype or in its accumulation type
  // (float32, float64 for float64), which keeps the mean unrounded for a normalisation that follows.
  void (*mean_forward)(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out);
  // As mean_forward with out in hidden's dtype, plus argmax [B, D] contiguous int32 (-1 for a text with no row).
  void (*max_forward)(const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out, at::Tensor& argmax);
  // scaled [B, D] contiguous in the accumulation type of grad_hidden's dtype (the gradient divided by each text's
  // row count); grad_hidden [B, L, D] contiguous, every row written: scaled[b] times how often the row is selected.
  void (*mean_backward)(const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden);
  // grad [B, D] contiguous, argmax [B, D] contiguous int32; grad_hidden [B, L, D] contiguous, every row written.
  void (*max_backward)(const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden);
  // positions [B, K] contiguous int64 (-1 or in [0, L)); out [B, K, D] contiguous, zero rows for -1. K may be 0.
  void (*gather_forward)(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out);
  // grad [B, K, D] contiguous; every row of grad_hidden [B, L, D] (contiguous) written: the sum of the grad rows
  // listing it, in k order in the accumulation type, rounded once (zero when none does).
  void (*gather_backward)(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden);
  // Attention pooling. hidden [B, L, D] with any strides; rows as AttentionRows says (bool tensors contiguous);
  // query [H, D / H] contiguous in the accumulation type. Writes every element of out [B, D] (hidden's dtype), the
  // softmax statistics stats [B, H, 2] (float64 {max score, sum of exp(score - max)}) of every text with a valid
  // row (the caller fills them with -inf first) and, when weights ([B, H, L], packed [H, T]; accumulation type,
  // zero-filled, contiguous) is defined, the probabilities of the valid rows.
  void (*attention_forward)(const at::Tensor& hidden, const AttentionRows& rows, const at::Tensor& query,
                            double scale, at::Tensor& out, at::Tensor& stats, at::Tensor& weights);
  // grad [B, D], grad_weights (shaped as the weights, or undefined) and out [B, D] (the forward's output)
  // contiguous in the accumulation type; stats as the forward wrote them. Writes every element of grad_hidden
  // ([B, L, D], packed [T, D]; hidden's dtype, contiguous) and of grad_query [H, D / H] (accumulation type).
  void (*attention_backward)(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                             const AttentionRows& rows, const at::Tensor& query, const at::Tensor& out,
                             const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query);
};

namespace cpu {
// The kernels for the best CPU capability this machine runs (ATEN_CPU_CAPABILITY caps it, as it does ATen's).
const Kernels& kernels();
// Which capability cpu::kernels() uses: "DEFAULT", "AVX2" or "AVX512".
const std::string& kernels_capability();
}  // namespace cpu

#ifdef LMK_OPS_WITH_CUDA
namespace cuda {
const Kernels& kernels();
}  // namespace cuda
#endif

// The table for t's device (the ops register only for devices that have one).
const Kernels& kernels_for(const at::Tensor& t);

}  // namespace lmk_ops

// Registers the op implementations that register(torch::Library&) adds, for every device with a kernel table.
#ifdef LMK_OPS_WITH_CUDA
#define LMK_OPS_REGISTER_CUDA(register) \
  TORCH_LIBRARY_IMPL(lmk_ops, CUDA, m) {  \
    register(m);                         \
  }
#else
#define LMK_OPS_REGISTER_CUDA(register)
#endif
#define LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register) \
  TORCH_LIBRARY_IMPL(lmk_ops, CPU, m) {             \
    register(m);                                    \
  }                                                 \
  LMK_OPS_REGISTER_CUDA(register)
