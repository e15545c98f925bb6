// first_token_pool and last_token_pool as one op, token_pool, for every device and both layouts: find each text's
// first (or last) valid row, copy it out. The backward is landmark_gather_backward at the returned positions.
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/host_path.h"
#include "common/packed.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"

namespace lmk_ops::ops {
namespace {

// Each text's first (or last) valid row, as [B, 1] columns: an absolute row number of its span [start, start +
// length), and a position from the text's start; -1 for a text with none. valid: bool over the rows (undefined:
// every row). On the CPU one scan that stops at the first hit (the usual text starts with a valid token); elsewhere
// ATen reductions, which never synchronise. Errors name op.
std::tuple<Tensor, Tensor> find_rows(const char* op, const Tensor& valid, const Tensor& starts, const Tensor& lengths,
                                     int64_t rows, bool last) {
  if (takes_host_path(starts)) {
    const int64_t batch = starts.size(0);
    Tensor found = empty_on(starts, {batch, 1}, ScalarType::Long);
    Tensor positions = empty_on(starts, {batch, 1}, ScalarType::Long);
    const bool* v = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;
    const int64_t* s = starts.const_data_ptr<int64_t>();
    const int64_t* n = lengths.const_data_ptr<int64_t>();
    int64_t* row_out = found.mutable_data_ptr<int64_t>();
    int64_t* position_out = positions.mutable_data_ptr<int64_t>();
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
  Tensor found;
  if (!valid.defined()) {
    found = where(ge(lengths, 1), last ? sub(add(starts, lengths), 1) : starts, -1);
  } else {
    // The smallest (largest) valid row of each text: rows of other texts and invalid rows are out of the running.
    const int64_t none = last ? -1 : rows;
    const Tensor candidates = where(valid, arange_on(starts, rows), none);
    found = aten("aten::scatter_reduce", "two", full_on(starts, {starts.size(0)}, static_cast<double>(none),
                                                        ScalarType::Long),
                 int64_t{0}, text_of_rows(lengths, rows, op), candidates, std::string(last ? "amax" : "amin"), true);
    found = where(ne(found, none), found, -1);
  }
  const auto column = [](const Tensor& t) { return torch::stable::unsqueeze(t, 1); };
  return {column(found), column(where(ge(found, 0), sub(found, starts), -1))};
}

// A padded batch of `batch` texts of seq_len rows, as spans of its flattened rows: (starts, lengths), int64 [B]; on
// the host (find_rows' host loop), where the generic form costs several operator calls on a microsecond op.
std::tuple<Tensor, Tensor> padded_spans(const Tensor& like, int64_t batch, int64_t seq_len) {
  Tensor starts = empty_on(like, {batch}, ScalarType::Long), lengths = empty_on(like, {batch}, ScalarType::Long);
  int64_t* s = starts.mutable_data_ptr<int64_t>();
  int64_t* n = lengths.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    s[b] = b * seq_len;
    n[b] = seq_len;
  }
  return {starts, lengths};
}

// Each text's first (or last) valid position in a padded batch, int64 [B, 1], -1 for a text with none, off the
// host: argmax over the text's flags (ATen's argmax takes the lowest index of equal maxima on every device), the
// last from the flipped flags. valid: bool [B, L] (undefined: every row). Eleven operator calls at most, where the
// flattened form of find_rows took some sixty, 0.7 ms of an H100 host's time a call.
Tensor padded_positions(const Tensor& valid, int64_t batch, int64_t seq_len, bool last, const Tensor& like) {
  if (!valid.defined() || seq_len == 0) {
    const double position = seq_len == 0 ? -1.0 : (last ? static_cast<double>(seq_len - 1) : 0.0);
    return full_on(like, {batch, 1}, position, ScalarType::Long);
  }
  const Tensor flags = last ? aten("aten::flip", "", valid, std::vector<int64_t>{1}) : valid;
  const Tensor found = aten("aten::argmax", "", to_dtype(flags, ScalarType::Byte), std::optional<int64_t>(1), true);
  const Tensor any = aten("aten::gather", "", flags, int64_t{1}, found, false);
  return where(any, last ? sub(full_on(found, {}, static_cast<double>(seq_len - 1), ScalarType::Long), found) : found,
               -1);
}

std::tuple<Tensor, Tensor> token_pool(const Tensor& hidden, const std::optional<Tensor>& mask, bool last,
                                      const std::optional<Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen) {
  const char* op = last ? "last_token_pool" : "first_token_pool";
  Tensor view, rows, positions;
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    std::tie(rows, positions) = find_rows(op, valid, packed.starts, packed.lengths, hidden.size(0), last);
    view = packed.batch_view(hidden);
  } else {
    check_hidden(op, hidden, max_seqlen);
    const int64_t batch = hidden.size(0), seq_len = hidden.size(1);
    const Tensor valid = prepare_mask(op, mask, batch, seq_len, hidden);
    if (takes_host_path(hidden)) {  // the padded batch as texts of L rows each, one after another
      const auto [starts, lengths] = padded_spans(hidden, batch, seq_len);
      std::tie(rows, positions) = find_rows(
          op, valid.defined() ? torch::stable::view(valid, {batch * seq_len}) : valid, starts, lengths,
          batch * seq_len, last);
    } else {
      positions = padded_positions(valid, batch, seq_len, last, hidden);
    }
    rows = positions;  // the gather reads positions of each text
    view = hidden;
  }
  // The output is a tensor of its own, not a view: autograd refuses in-place changes (emb /= norm) to a view made
  // inside an op. The gather writes it as [B, 1, D].
  Tensor out = empty_on(hidden, {view.size(0), view.size(2)}, hidden.scalar_type());
  if (out.numel() > 0) {
    Tensor one_row_each = torch::stable::view(out, {view.size(0), 1, view.size(2)});
    kernels_for(hidden).gather_forward(view, rows, one_row_each);
  }
  // Positions from each text's start, as landmark_gather_backward takes them.
  return {out, positions};
}

void register_token_ops(torch::stable::detail::StableLibrary& m) {
  LMK_OPS_IMPL(m, "token_pool", token_pool);
}

}  // namespace

LMK_OPS_REGISTER_FOR_EVERY_DEVICE(register_token_ops)

}  // namespace lmk_ops::ops
