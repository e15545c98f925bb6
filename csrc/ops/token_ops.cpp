// first_token_pool and last_token_pool as one op, token_pool, for every device and both layouts: find each text's
// first (or last) valid row, copy it out. The backward is landmark_gather_backward at the returned positions.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/checks.h"
#include "common/packed.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {
namespace {

// Each text's first (or last) valid row as an absolute row number of its span [start, start + length), -1 for a
// text with none. valid: bool over the rows (undefined: every row). On the CPU a scan that stops at the first hit
// (the usual text starts with a valid token); elsewhere ATen reductions, which never synchronise.
at::Tensor find_rows(const at::Tensor& valid, const at::Tensor& starts, const at::Tensor& lengths, int64_t rows,
                     bool last) {
  if (!valid.defined()) {
    return at::where(lengths.gt(0), last ? starts + lengths - 1 : starts, -1);
  }
  if (valid.is_cpu()) {
    at::Tensor found = at::empty({starts.size(0)}, starts.options());
    const bool* v = valid.const_data_ptr<bool>();
    const int64_t* s = starts.const_data_ptr<int64_t>();
    const int64_t* n = lengths.const_data_ptr<int64_t>();
    int64_t* out = found.data_ptr<int64_t>();
    for (int64_t b = 0; b < starts.size(0); ++b) {
      out[b] = -1;
      for (int64_t i = 0; i < n[b]; ++i) {
        const int64_t row = last ? s[b] + n[b] - 1 - i : s[b] + i;
        if (v[row]) {
          out[b] = row;
          break;
        }
      }
    }
    return found;
  }
  // The smallest (largest) valid row of each text: rows of other texts and invalid rows are out of the running.
  const at::Tensor text = at::arange(starts.size(0), starts.options()).repeat_interleave(lengths, 0, rows);
  const at::Tensor index = at::arange(rows, starts.options());
  const int64_t none = last ? -1 : rows;
  const at::Tensor found = at::full({starts.size(0)}, none, starts.options())
                               .scatter_reduce(0, text, at::where(valid, index, none), last ? "amax" : "amin");
  return at::where(found.eq(none), -1, found);
}

std::tuple<at::Tensor, at::Tensor> token_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                                              bool last, const std::optional<at::Tensor>& cu_seqlens,
                                              std::optional<int64_t> max_seqlen) {
  const char* op = last ? "last_token_pool" : "first_token_pool";
  at::Tensor view, valid, rows;
  std::optional<PackedBatch> packed;
  if (cu_seqlens.has_value()) {
    packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    valid = prepare_packed_mask(op, mask, *packed, hidden);
    rows = find_rows(valid, packed->starts, packed->lengths, hidden.size(0), last);
    view = packed->batch_view(hidden);
  } else {
    check_hidden(op, hidden);
    const int64_t batch = hidden.size(0), seq_len = hidden.size(1);
    valid = prepare_mask(op, mask, batch, seq_len, hidden);
    // The padded batch as texts of L rows each, one after another.
    const auto options = hidden.options().dtype(at::kLong);
    const at::Tensor starts = at::arange(batch, options) * seq_len;
    rows = find_rows(valid.defined() ? valid.view({-1}) : valid, starts, at::full({batch}, seq_len, options),
                     batch * seq_len, last);
    rows = at::where(rows.ge(0), rows - starts, -1);
    view = hidden;
  }
  at::Tensor positions = rows.unsqueeze(1).contiguous();
  at::Tensor out = at::empty({view.size(0), 1, view.size(2)}, hidden.options());
  if (out.numel() > 0) {
    kernels_for(hidden).gather_forward(view, positions, out);
  }
  // Positions from each text's start, as landmark_gather_backward takes them.
  return {out.view({view.size(0), view.size(2)}), packed.has_value() ? packed->relative(positions) : positions};
}

void register_token_ops(torch::Library& m) {
  m.impl("token_pool", &token_pool);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_token_ops)

}  // namespace lmk_ops::ops
