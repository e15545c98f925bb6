#pragma once
// Row listing, device-side value checks and the CUDA kernels that write whole rows (rows.cu); documented in
// common/kernel_types.h.
#include <string>

#include "cuda/kernel_types.h"

namespace lmk_ops::cuda {

// What report_out_of_range prints before ", got V ...": a kernel argument, so the text travels by value.
struct RangeMessage {
  char expected[kDeviceMessageBytes];
  EntryName naming;
  bool flat;  // values of one dimension: "at [i]"
};

void check_range(const Tensor& values, int64_t lo, int64_t hi, const Tensor& row_limits,
                 const std::string& expected, EntryName naming);
void grad_over_counts(const Tensor& grad, const Tensor& counts, const Tensor& mask, const Tensor& offsets,
                      const Tensor& positions, int64_t seq_len, Tensor& scaled);
void mean_backward(const Tensor& scaled, const RowSelection& rows, Tensor& grad_hidden);
void max_backward(const Tensor& grad, const Tensor& argmax, const Tensor& offsets, Tensor& grad_hidden);
void gather_forward(const Tensor& hidden, const Tensor& positions, const Tensor& starts, Tensor& out);
void gather_backward(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden);
void find_rows(const Tensor& valid, const Tensor& offsets, int64_t batch, int64_t seq_len, bool last,
               Tensor& positions, Tensor& counts);
void shift_rows(const Tensor& values, const Tensor& starts, int64_t sign, Tensor& out);
void packed_offsets(const Tensor& cu_seqlens, const OffsetChecks* checks, Tensor& offsets, Tensor& lengths);

}  // namespace lmk_ops::cuda
