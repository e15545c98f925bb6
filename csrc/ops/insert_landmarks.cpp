// insert_landmarks: a landmark token after every chunk of each text of a padded batch of token ids
// (lmk_ops.insert_landmarks documents the layout). Host memory only: token ids are small, and the new rows' width
// depends on their values, so a device version would wait for the host anyway; the Python function brings device
// inputs over and the result back. Two loops over the rows: the first lays each row out (its length), the second
// writes it. As tensor operations the same work cost ~60 operator calls, 0.4 ms for one 16-token query.
#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/error.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"

namespace lmk_ops::ops {
namespace {

constexpr const char* kOp = "insert_landmarks";

// One text's layout. Its valid tokens are num_lead leading specials, num_content content tokens and num_trail
// trailing specials; the body is the leading specials and the content with the landmarks, cut to body_limit.
struct RowLayout {
  int64_t num_lead = 0, num_content = 0, num_trail = 0;
  int64_t body_limit = 0;  // body tokens kept
  int64_t kept_trail = 0;  // trailing specials written after the body (keep_trailing)
  int64_t length() const { return body_limit + kept_trail; }
};

// What every row's layout takes alike (a row's interval and sentence ends are lay_out's own arguments).
struct Options {
  int64_t num_leading, num_trailing;
  bool keep_trailing;
  std::optional<int64_t> max_length;
};

// Whether content token i (of n) of a row ends a chunk: at each interval, at a marked sentence end, and always at
// the last one.
bool ends_chunk(int64_t i, int64_t n, int64_t every, const bool* sentence_end_of_row, int64_t column) {
  if (i == n - 1) {
    return true;
  }
  return sentence_end_of_row != nullptr ? sentence_end_of_row[column] : (i + 1) % every == 0;
}

RowLayout lay_out(const int64_t* columns, int64_t length, int64_t every, const bool* sentence_end_of_row,
                  const Options& o) {
  RowLayout row;
  row.num_lead = std::min(length, o.num_leading);
  const int64_t rest = length - row.num_lead;
  row.num_trail = std::min(o.num_trailing, rest);
  row.num_content = rest - row.num_trail;
  int64_t landmarks = 0;
  if (row.num_content == 0) {
    landmarks = length > 0 ? 1 : 0;  // an empty text still gets one; a row of padding alone stays empty
  } else if (sentence_end_of_row == nullptr) {
    landmarks = 1 + (row.num_content - 1) / every;  // rounded up, with no overflow for an interval near 2^63
  } else {
    for (int64_t i = 0; i < row.num_content; ++i) {
      landmarks += ends_chunk(i, row.num_content, every, sentence_end_of_row, columns[row.num_lead + i]);
    }
  }
  row.kept_trail = o.keep_trailing ? row.num_trail : 0;
  row.body_limit = row.num_lead + row.num_content + landmarks;
  if (o.max_length.has_value()) {
    const int64_t room = *o.max_length - row.kept_trail;
    LMK_CHECK(
        room >= row.num_lead + 1, "lmk_ops.", kOp, ": expected max_length >= ", o.num_leading, " leading + ",
        o.keep_trailing ? o.num_trailing : 0, " trailing special tokens + 1 landmark, got max_length = ",
        *o.max_length);
    row.body_limit = std::min(row.body_limit, room);
  }
  return row;
}

// Writes one text's new row at out_* (its first slot): the body, cut at body_limit, then the kept trailing
// specials. If no landmark survived the cut, the last body token becomes one.
void write_row(const RowLayout& row, const int64_t* ids, const int64_t* columns, int64_t every,
               const bool* sentence_end_of_row, int64_t landmark_id, int64_t* out_ids, bool* out_landmarks) {
  int64_t at = 0;
  bool any_landmark = false;
  const auto put = [&](int64_t id, bool landmark) {
    if (at < row.body_limit) {
      out_ids[at] = id;
      out_landmarks[at++] = landmark;
      any_landmark |= landmark;
    }
  };
  for (int64_t i = 0; i < row.num_lead; ++i) {
    put(ids[columns[i]], false);
  }
  for (int64_t i = 0; i < row.num_content && at < row.body_limit; ++i) {
    const int64_t column = columns[row.num_lead + i];
    put(ids[column], false);
    if (ends_chunk(i, row.num_content, every, sentence_end_of_row, column)) {
      put(landmark_id, true);
    }
  }
  if (row.num_content == 0) {  // an empty text's one landmark (none fits in a row of padding alone)
    put(landmark_id, true);
  }
  if (!any_landmark && row.body_limit > 0) {
    out_ids[row.body_limit - 1] = landmark_id;
    out_landmarks[row.body_limit - 1] = true;
  }
  const int64_t* trail = columns + row.num_lead + row.num_content;
  for (int64_t i = 0; i < row.kept_trail; ++i) {
    out_ids[row.body_limit + i] = ids[trail[i]];
  }
}

std::tuple<Tensor, Tensor, Tensor> insert_landmarks(
    const Tensor& input_ids, const std::optional<Tensor>& attention_mask, const std::optional<Tensor>& sentence_ends,
    const std::optional<Tensor>& intervals, int64_t interval, int64_t landmark_id, int64_t pad_id,
    int64_t num_leading, int64_t num_trailing, bool keep_trailing, std::optional<int64_t> max_length,
    std::optional<std::string> padding_side) {
  LMK_CHECK(
      input_ids.is_cpu() && input_ids.dim() == 2 && is_integral(input_ids.scalar_type()), "lmk_ops.", kOp,
      ": expected input_ids as an integer CPU tensor [B, L], got ", input_ids.scalar_type(), " of shape ",
      shape_str(input_ids.sizes()));
  LMK_CHECK(
      num_leading >= 0 && num_trailing >= 0 && interval >= 1 && max_length.value_or(1) >= 1, "lmk_ops.", kOp,
      ": expected num_leading >= 0, num_trailing >= 0, interval >= 1 and max_length >= 1, got ", num_leading, ", ",
      num_trailing, ", ", interval, " and ", max_length.value_or(1));
  LMK_CHECK(
      !padding_side.has_value() || *padding_side == "left" || *padding_side == "right", "lmk_ops.", kOp,
      ": expected padding_side 'left', 'right' or None, got '", padding_side.value_or(""), "'");
  const int64_t batch = input_ids.size(0), seq_len = input_ids.size(1);
  const Tensor ids = as_contiguous(to_dtype(input_ids, ScalarType::Long));
  // Each a bool or integer 0/1 tensor [B, L], as contiguous bool (its values checked: one loop on the CPU).
  const Tensor valid = prepare_mask(kOp, attention_mask, batch, seq_len, input_ids, Values::kCheck, "attention_mask");
  const Tensor ends = prepare_mask(kOp, sentence_ends, batch, seq_len, input_ids, Values::kCheck, "sentence_ends");
  Tensor every_row;
  if (intervals.has_value()) {
    LMK_CHECK(
        intervals->is_cpu() && intervals->dim() == 1 && intervals->size(0) == batch &&
            is_integral(intervals->scalar_type()),
        "lmk_ops.", kOp, ": expected per-row intervals as an integer CPU tensor [B] = [", batch, "], got ",
        intervals->scalar_type(), " of shape ", shape_str(intervals->sizes()));
    every_row = as_contiguous(to_dtype(*intervals, ScalarType::Long));
    kernels_for(every_row).check_range(every_row, 1, std::numeric_limits<int64_t>::max(), Tensor(),
                                       std::string("lmk_ops.") + kOp + ": expected per-row intervals >= 1",
                                       EntryName::kIndex);
  }
  const Options o{num_leading, num_trailing, keep_trailing, max_length};
  const int64_t* every = every_row.defined() ? every_row.const_data_ptr<int64_t>() : nullptr;  // else interval
  const bool* end = ends.defined() ? ends.const_data_ptr<bool>() : nullptr;  // else fixed chunks
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const bool* v = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;

  // The valid tokens' columns, row after row, and each row's share of them.
  std::vector<int64_t> columns;
  columns.reserve(static_cast<size_t>(batch * seq_len));
  std::vector<int64_t> first_column(static_cast<size_t>(batch) + 1, 0);
  bool left_padded = false;  // a row padded at the front: the input is left-padded
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t l = 0; l < seq_len; ++l) {
      if (v == nullptr || v[b * seq_len + l]) {
        columns.push_back(l);
      }
    }
    first_column[b + 1] = static_cast<int64_t>(columns.size());
    left_padded |= v != nullptr && seq_len > 0 && !v[b * seq_len] && v[b * seq_len + seq_len - 1];
  }
  const bool left = padding_side.has_value() ? *padding_side == "left" : left_padded;

  const auto row_interval = [&](int64_t b) { return every != nullptr ? every[b] : interval; };
  const auto row_ends = [&](int64_t b) { return end != nullptr ? end + b * seq_len : nullptr; };
  std::vector<RowLayout> rows(static_cast<size_t>(batch));
  int64_t width = 0;
  for (int64_t b = 0; b < batch; ++b) {
    rows[b] = lay_out(columns.data() + first_column[b], first_column[b + 1] - first_column[b], row_interval(b),
                      row_ends(b), o);
    width = std::max(width, rows[b].length());
  }

  Tensor out_ids = empty_on(ids, {batch, width}, ScalarType::Long);
  Tensor out_mask = zeros_on(ids, {batch, width}, ScalarType::Long);
  Tensor out_landmarks = zeros_on(ids, {batch, width}, ScalarType::Bool);
  int64_t* oi = out_ids.mutable_data_ptr<int64_t>();
  int64_t* om = out_mask.mutable_data_ptr<int64_t>();
  bool* ol = out_landmarks.mutable_data_ptr<bool>();
  std::fill(oi, oi + batch * width, pad_id);
  for (int64_t b = 0; b < batch; ++b) {
    const RowLayout& row = rows[b];
    const int64_t start = b * width + (left ? width - row.length() : 0);
    write_row(row, id + b * seq_len, columns.data() + first_column[b], row_interval(b), row_ends(b), landmark_id,
              oi + start, ol + start);
    std::fill(om + start, om + start + row.length(), int64_t{1});
  }
  return {to_dtype(out_ids, input_ids.scalar_type()), out_mask, out_landmarks};
}

void register_insert_landmarks(torch::stable::detail::StableLibrary& m) {
  LMK_OPS_IMPL(m, "insert_landmarks", insert_landmarks);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(lmk_ops, CPU, m) {
  register_insert_landmarks(m);
}

}  // namespace lmk_ops::ops
