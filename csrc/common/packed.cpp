#include "common/packed.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <limits>
#include <string>

#include "common/dispatch.h"
#include "common/device_name.h"
#include "common/error.h"
#include "ops/kernels.h"

namespace lmk_ops {
namespace {

std::string message(const char* op, const std::string& expected) {
  return std::string("lmk_ops.") + op + ": " + expected;
}

// The number of selected rows before each row, and after the last: [T + 1] int64.
at::Tensor selected_before(const at::Tensor& selected) {
  const at::Tensor counted = selected.cumsum(0, at::kLong);
  return at::cat({at::zeros({1}, counted.options()), counted});
}

// The values of a packed batch's offsets: first 0, last T, non-decreasing, no text longer than max_seqlen; a
// failure names the entry as check_range does. On the CPU plain loops over the B + 1 offsets, with the messages
// written only on failure (four kernel calls would cost more than a first_token_pool's work); elsewhere the device's
// check_range, which never synchronises.
void check_offsets(const char* op, const PackedBatch& packed, const at::Tensor& like) {
  const int64_t longest = packed.max_seqlen.value_or(std::numeric_limits<int64_t>::max());
  const auto first_zero = [&] { return message(op, "expected cu_seqlens[0] = 0"); };
  const auto last_tokens = [&] {
    return message(op, "expected cu_seqlens[-1] = T = " + std::to_string(packed.tokens) + " (hidden's rows)");
  };
  const auto ordered = [&] {
    return message(op, "expected non-decreasing cu_seqlens (text b has cu_seqlens[b + 1] - cu_seqlens[b] >= 0 "
                       "tokens; the value is that length, the column b)");
  };
  const auto at_most = [&] {
    return message(op, "expected every text at most max_seqlen = " + std::to_string(longest) +
                           " tokens long (the value is a text's length, the column its index)");
  };
  if (packed.offsets.is_cpu()) {
    const int64_t* o = packed.offsets.const_data_ptr<int64_t>();
    const int64_t* n = packed.lengths.const_data_ptr<int64_t>();
    const int64_t* end = n + packed.batch;
    const auto fail_at = [](const std::string& expected, int64_t value, int64_t column) {
      fail(expected, ", got ", value, " at [0, ", column, "]");
    };
    if (o[0] != 0) {
      fail_at(first_zero(), o[0], 0);
    }
    if (o[packed.batch] != packed.tokens) {
      fail_at(last_tokens(), o[packed.batch], 0);
    }
    if (const int64_t* bad = std::find_if(n, end, [](int64_t length) { return length < 0; }); bad != end) {
      fail_at(ordered(), *bad, bad - n);
    }
    if (const int64_t* bad = std::find_if(n, end, [&](int64_t length) { return length > longest; }); bad != end) {
      fail_at(at_most(), *bad, bad - n);
    }
    return;
  }
  const Kernels& k = kernels_for(like);
  k.check_range(packed.offsets.narrow(0, 0, 1).view({1, 1}), 0, 0, first_zero(), false);
  k.check_range(packed.offsets.narrow(0, packed.batch, 1).view({1, 1}), packed.tokens, packed.tokens, last_tokens(),
                false);
  if (packed.batch > 0) {
    const at::Tensor lengths = packed.lengths.view({1, packed.batch});
    k.check_range(lengths, 0, std::numeric_limits<int64_t>::max(), ordered(), false);
    if (packed.max_seqlen.has_value()) {
      k.check_range(lengths, 0, longest, at_most(), false);
    }
  }
}

}  // namespace

int64_t PackedBatch::width() const {
  if (max_seqlen.has_value()) {
    return *max_seqlen;
  }
  return batch == 0 ? 0 : lengths.max().item<int64_t>();
}

at::Tensor PackedBatch::batch_view(const at::Tensor& hidden) const {
  return hidden.as_strided({batch, tokens, hidden.size(1)}, {0, hidden.stride(0), hidden.stride(1)});
}

at::Tensor PackedBatch::text_of_rows() const {
  return at::arange(batch, offsets.options()).repeat_interleave(lengths, 0, tokens);
}

at::Tensor PackedBatch::absolute(const at::Tensor& positions) const {
  return at::where(positions.ge(0), positions + starts.unsqueeze(1), -1);
}

at::Tensor PackedBatch::relative(const at::Tensor& rows) const {
  if (rows.is_cpu()) {  // one loop: a max_pool's [B, D] positions through three ATen ops cost 5% of its time
    at::Tensor out = rows.clone(at::MemoryFormat::Contiguous);
    const int64_t* s = starts.const_data_ptr<int64_t>();
    const int64_t width = rows.size(1);
    LMK_DISPATCH_INDEX(out.scalar_type(), "relative", [&] {
      index_t* r = out.data_ptr<index_t>();
      for (int64_t i = 0; i < out.numel(); ++i) {
        r[i] = r[i] >= 0 ? static_cast<index_t>(r[i] - s[i / width]) : index_t(-1);
      }
    });
    return out;
  }
  return at::where(rows.ge(0), rows - starts.unsqueeze(1), -1).to(rows.scalar_type());
}

at::Tensor PackedBatch::list_rows(const at::Tensor& selected) const {
  if (offsets.is_cpu()) {  // two passes over the rows (count, list), where the ATen form below takes several
    const int64_t* o = offsets.const_data_ptr<int64_t>();
    const bool* s = selected.defined() ? selected.const_data_ptr<bool>() : nullptr;
    const auto selected_in = [&](int64_t b) {
      return s == nullptr ? o[b + 1] - o[b] : std::count(s + o[b], s + o[b + 1], true);
    };
    int64_t k = 0;  // as wide as the most rows a text has selected (landmarks: a few of its rows)
    for (int64_t b = 0; b < batch; ++b) {
      k = std::max<int64_t>(k, selected_in(b));
    }
    at::Tensor rows = at::full({batch, k}, -1, offsets.options());
    int64_t* out = rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      int64_t* listed = out + b * k;
      for (int64_t t = o[b], j = 0; t < o[b + 1]; ++t) {
        if (s == nullptr || s[t]) {
          listed[j++] = t;
        }
      }
    }
    return rows;
  }
  const int64_t k = width();
  if (!selected.defined()) {
    const at::Tensor column = at::arange(k, offsets.options()).unsqueeze(0);
    return at::where(column.lt(lengths.unsqueeze(1)), column + starts.unsqueeze(1), -1).contiguous();
  }
  // Each selected row goes to slot (its text, its rank among the text's selected rows); the others to a spare
  // last slot, dropped after.
  const at::Tensor text = text_of_rows();
  const at::Tensor before = selected_before(selected);
  const at::Tensor rank = before.narrow(0, 0, tokens) - before.index_select(0, starts).index_select(0, text);
  const at::Tensor slot = at::where(selected, text * k + rank, batch * k);
  at::Tensor rows = at::full({batch * k + 1}, -1, offsets.options());
  rows.scatter_(0, slot, at::arange(tokens, offsets.options()));
  return rows.narrow(0, 0, batch * k).view({batch, k});
}

RowSelection PackedBatch::selection(const at::Tensor& selected) const {
  if (offsets.is_cpu() && !selected.defined()) {
    return {at::Tensor(), at::Tensor(), starts.contiguous(), lengths.contiguous()};
  }
  return {at::Tensor(), list_rows(selected)};
}

at::Tensor PackedBatch::count(const at::Tensor& selected) const {
  const at::Tensor before = selected_before(selected);
  return before.index_select(0, offsets.narrow(0, 1, batch)) - before.index_select(0, starts);
}

PackedBatch prepare_packed(const char* op, int64_t tokens, const at::Tensor& like, const at::Tensor& cu_seqlens,
                           std::optional<int64_t> max_seqlen, Values values) {
  LMK_CHECK(
      cu_seqlens.device() == like.device(), "lmk_ops.", op, ": expected cu_seqlens on the same device as hidden (",
      device_name(like), "), got ", device_name(cu_seqlens));
  LMK_CHECK(
      cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, "lmk_ops.", op,
      ": expected cu_seqlens of dtype int32 or int64, got ", cu_seqlens.scalar_type());
  LMK_CHECK(
      cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "lmk_ops.", op,
      ": expected cu_seqlens of shape [B + 1] (1-D, at least one entry), got ", shape_str(cu_seqlens.sizes()));
  LMK_CHECK(
      !max_seqlen.has_value() || *max_seqlen >= 0, "lmk_ops.", op, ": expected max_seqlen >= 0, got ",
      max_seqlen.value_or(0));
  PackedBatch packed;
  packed.batch = cu_seqlens.size(0) - 1;
  packed.tokens = tokens;
  packed.max_seqlen = max_seqlen;
  if (cu_seqlens.is_cpu()) {  // one loop: the ATen ops would cost more than the work (a first_token_pool's share)
    packed.offsets = at::empty({packed.batch + 1}, cu_seqlens.options().dtype(at::kLong));
    packed.lengths = at::empty({packed.batch}, packed.offsets.options());
    int64_t* o = packed.offsets.data_ptr<int64_t>();
    int64_t* n = packed.lengths.data_ptr<int64_t>();
    const int64_t stride = cu_seqlens.stride(0);
    LMK_DISPATCH_INDEX(cu_seqlens.scalar_type(), "prepare_packed", [&] {
      const index_t* c = cu_seqlens.const_data_ptr<index_t>();
      for (int64_t b = 0; b <= packed.batch; ++b) {
        o[b] = c[b * stride];
        if (b > 0) {
          n[b - 1] = o[b] - o[b - 1];
        }
      }
    });
  } else {
    packed.offsets = cu_seqlens.to(at::kLong).contiguous();
    packed.lengths = packed.offsets.narrow(0, 1, packed.batch) - packed.offsets.narrow(0, 0, packed.batch);
  }
  packed.starts = packed.offsets.narrow(0, 0, packed.batch);
  if (values == Values::kCheck) {
    check_offsets(op, packed, like);
  }
  return packed;
}

PackedBatch prepare_packed_hidden(const char* op, const at::Tensor& hidden, const at::Tensor& cu_seqlens,
                                  std::optional<int64_t> max_seqlen, Values values) {
  check_packed_hidden(op, hidden);
  return prepare_packed(op, hidden.size(0), hidden, cu_seqlens, max_seqlen, values);
}

PackedBatch prepare_packed_grad(const char* op, const at::Tensor& grad, int64_t tokens, const at::Tensor& cu_seqlens) {
  PackedBatch packed = prepare_packed(op, tokens, grad, cu_seqlens, std::nullopt, Values::kTrusted);
  LMK_CHECK(
      packed.batch == grad.size(0), "lmk_ops.", op, ": expected grad_out with B = ", packed.batch,
      " texts (as cu_seqlens), got shape ", shape_str(grad.sizes()));
  return packed;
}

at::Tensor prepare_packed_mask(const char* op, const std::optional<at::Tensor>& mask, const PackedBatch& packed,
                               const at::Tensor& like, Values values) {
  if (!mask.has_value() || !mask->defined()) {
    return at::Tensor();
  }
  LMK_CHECK(
      mask->dim() == 1 && mask->size(0) == packed.tokens, "lmk_ops.", op,
      ": expected a packed mask of shape [T] = [", packed.tokens, "], got ", shape_str(mask->sizes()));
  return prepare_mask(op, mask->view({1, packed.tokens}), 1, packed.tokens, like, values).view({packed.tokens});
}

at::Tensor prepare_packed_positions(const char* op, const at::Tensor& positions, const PackedBatch& packed,
                                    const at::Tensor& like, Values values) {
  // Shape, dtype and device as for the padded positions; the range is each text's own length.
  const at::Tensor p = prepare_positions(op, positions, packed.batch, std::numeric_limits<int64_t>::max(), like,
                                         Values::kTrusted);
  if (values == Values::kCheck && p.numel() > 0) {
    // Only a bad entry keeps its value; every other becomes -1, so the first value that is not -1 is the culprit.
    const at::Tensor bad = p.lt(-1).logical_or(p.ge(packed.lengths.unsqueeze(1)));
    kernels_for(like).check_range(
        at::where(bad, p, -1).contiguous(), -1, -1,
        message(op, "expected landmark positions in [0, length of their text) (counted from the text's start in "
                    "cu_seqlens) or -1 for none"),
        /*landmarks=*/true);
  }
  return packed.absolute(p).contiguous();
}

at::Tensor prepare_packed_landmark_mask(const char* op, const at::Tensor& landmarks, const PackedBatch& packed,
                                        const at::Tensor& like) {
  check_landmarks_device(op, landmarks, like);
  LMK_CHECK(
      landmarks.dim() == 1 && landmarks.size(0) == packed.tokens, "lmk_ops.", op,
      ": expected a packed landmark mask of shape [T] = [", packed.tokens, "], got ", shape_str(landmarks.sizes()));
  return landmarks.contiguous();
}

RowSelection prepare_packed_landmarks(const char* op, const at::Tensor& landmarks, const PackedBatch& packed,
                                      const at::Tensor& like, Values values) {
  LMK_CHECK(
      landmarks.scalar_type() == at::kBool || landmarks.scalar_type() == at::kLong, "lmk_ops.", op,
      ": expected packed landmarks as a bool mask [T] or int64 positions [B, K] padded with -1, got ",
      landmarks.scalar_type());
  if (landmarks.scalar_type() == at::kLong) {
    return {at::Tensor(), prepare_packed_positions(op, landmarks, packed, like, values)};
  }
  return {at::Tensor(), packed.list_rows(prepare_packed_landmark_mask(op, landmarks, packed, like))};
}

}  // namespace lmk_ops
