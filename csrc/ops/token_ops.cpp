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
#include <utility>

#include "common/checks.h"
#include "common/packed.h"
#include "ops/kernels.h"

namespace lmk_ops::ops {
namespace {

// Each text's first (or last) valid row: as an absolute row number of its span [start, start + length), and as a
// position from the text's start; -1 for a text with none. valid: bool over the rows (undefined: every row). On the
// CPU one scan that stops at the first hit (the usual text starts with a valid token); elsewhere ATen reductions,
// which never synchronise.
std::tuple<at::Tensor, at::Tensor> find_rows(const at::Tensor& valid, const at::Tensor& starts,
                                             const at::Tensor& lengths, int64_t rows, bool last) {
  if (starts.is_cpu()) {
    const int64_t batch = starts.size(0);
    at::Tensor found = at::empty({batch}, starts.options()), positions = at::empty({batch, 1}, starts.options());
    const bool* v = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;
    const int64_t* s = starts.const_data_ptr<int64_t>();
    const int64_t* n = lengths.const_data_ptr<int64_t>();
    int64_t* row_out = found.data_ptr<int64_t>();
    int64_t* position_out = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      row_out[b] = position_out[b] = -1;
      for (int64_t i = 0; i < n[b]; ++i) {
        const int64_t position = last ? n[b] - 1 - i : i;
        if (v == nullptr || v[s[b] + position]) {
          row_out[b] = s[b] + position;
          position_out[b] = position;
          break;
        }
      }
    }
    return {found, positions};
  }
  at::Tensor found;
  if (!valid.defined()) {
    found = at::where(lengths.gt(0), last ? starts + lengths - 1 : starts, -1);
  } else {
    // The smallest (largest) valid row of each text: rows of other texts and invalid rows are out of the running.
    const at::Tensor text = at::arange(starts.size(0), starts.options()).repeat_interleave(lengths, 0, rows);
    const at::Tensor index = at::arange(rows, starts.options());
    const int64_t none = last ? -1 : rows;
    found = at::full({starts.size(0)}, none, starts.options())
                .scatter_reduce(0, text, at::where(valid, index, none), last ? "amax" : "amin");
    found = at::where(found.eq(none), -1, found);
  }
  return {found, at::where(found.ge(0), found - starts, -1).unsqueeze(1)};
}

std::tuple<at::Tensor, at::Tensor> token_pool(const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                                              bool last, const std::optional<at::Tensor>& cu_seqlens,
                                              std::optional<int64_t> max_seqlen) {
  const char* op = last ? "last_token_pool" : "first_token_pool";
  at::Tensor view, rows, positions;
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const at::Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    std::tie(rows, positions) = find_rows(valid, packed.starts, packed.lengths, hidden.size(0), last);
    rows = rows.unsqueeze(1);  // the gather reads absolute rows of the [B, T, D] view
    view = packed.batch_view(hidden);
  } else {
    check_hidden(op, hidden);
    const int64_t batch = hidden.size(0), seq_len = hidden.size(1);
    const at::Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden);
    // The padded batch as texts of L rows each, one after another.
    const auto options = hidden.options().dtype(at::kLong);
    std::tie(rows, positions) = find_rows(valid.defined() ? valid.view({-1}) : valid,
                                          at::arange(batch, options) * seq_len, at::full({batch}, seq_len, options),
                                          batch * seq_len, last);
    rows = positions;  // the gather reads positions of each text
    view = hidden;
  }
  at::Tensor out = at::empty({view.size(0), 1, view.size(2)}, hidden.options());
  if (out.numel() > 0) {
    kernels_for(hidden).gather_forward(view, rows, out);
  }
  // Positions from each text's start, as landmark_gather_backward takes them.
  return {out.view({view.size(0), view.size(2)}), positions};
}

void register_token_ops(torch::Library& m) {
  m.impl("token_pool", &token_pool);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_token_ops)

}  // namespace lmk_ops::ops
