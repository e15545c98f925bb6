#include "common/packed.h"

#include <limits>
#include <string>

#include "common/device_name.h"
#include "common/error.h"
#include "ops/kernels.h"

namespace lmk_ops {
namespace {

std::string message(const char* op, const std::string& expected) {
  return std::string("lmk_ops.") + op + ": " + expected;
}

}  // namespace

std::string OffsetChecks::message(OffsetCheck check) const {
  switch (check) {
    case OffsetCheck::kFirst:
      return lmk_ops::message(op, "expected cu_seqlens[0] = 0");
    case OffsetCheck::kLast:
      return lmk_ops::message(op, "expected cu_seqlens[-1] = T = " + std::to_string(tokens) + " (" + tokens_are + ")");
    case OffsetCheck::kOrder:
      return lmk_ops::message(op, "expected non-decreasing cu_seqlens (text b has cu_seqlens[b + 1] - cu_seqlens[b] "
                                  ">= 0 tokens; the value is that length, the index b)");
    case OffsetCheck::kLongest:
      break;
  }
  return lmk_ops::message(op, "expected every text at most max_seqlen = " + std::to_string(longest) +
                                  " tokens long (the value is a text's length, the index its text's)");
}

Tensor PackedBatch::batch_view(const Tensor& hidden) const {
  return as_strided(hidden, {batch, tokens, hidden.size(1)}, {0, hidden.stride(0), hidden.stride(1)});
}

Tensor PackedBatch::absolute(const Tensor& positions) const {
  const Tensor values = as_contiguous(positions);
  // A copy that as_contiguous made is shifted in place; the caller's positions are never written.
  Tensor rows = values.data_ptr() == positions.data_ptr() ? empty_on(values, values.sizes(), values.scalar_type())
                                                          : values;
  kernels_for(values).shift_rows(values, offsets, 1, rows);
  return rows;
}

Tensor PackedBatch::relative(Tensor rows) const {
  kernels_for(rows).shift_rows(rows, offsets, -1, rows);
  return rows;
}

RowSelection PackedBatch::selection(const Tensor& selected) const {
  return {selected, Tensor(), lengths, offsets};
}

PackedBatch prepare_packed(const char* op, int64_t tokens, const Tensor& like, const Tensor& cu_seqlens,
                           std::optional<int64_t> max_seqlen, Values values, const char* tokens_are,
                           PackedReads reads) {
  LMK_CHECK(
      cu_seqlens.device() == like.device(), "lmk_ops.", op, ": expected cu_seqlens on the same device as hidden (",
      device_name(like), "), got ", device_name(cu_seqlens));
  LMK_CHECK(
      cu_seqlens.scalar_type() == ScalarType::Int || cu_seqlens.scalar_type() == ScalarType::Long, "lmk_ops.", op,
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
  // The kernels read the texts' starts as the offsets' first B entries: a tensor of starts, or a view of the
  // offsets, costs an allocation, a measurable share of a first_token_pool call on the CPU.
  Tensor converted;  // what packed_offsets writes: undefined where cu_seqlens is read as it is (only checked)
  if (reads == PackedReads::kGivenOffsets && cu_seqlens.stride(0) == 1) {
    packed.offsets = cu_seqlens;
  } else {
    converted = packed.offsets = empty_on(cu_seqlens, {packed.batch + 1}, ScalarType::Long);
  }
  if (reads == PackedReads::kLengths) {
    packed.lengths = empty_on(cu_seqlens, {packed.batch}, ScalarType::Long);
  }
  const OffsetChecks checks{op, tokens_are, tokens, max_seqlen.value_or(std::numeric_limits<int64_t>::max())};
  kernels_for(like).packed_offsets(cu_seqlens, values == Values::kCheck ? &checks : nullptr, converted,
                                   packed.lengths);
  return packed;
}

PackedBatch prepare_packed_hidden(const char* op, const Tensor& hidden, const Tensor& cu_seqlens,
                                  std::optional<int64_t> max_seqlen, PackedReads reads) {
  check_packed_hidden(op, hidden);
  return prepare_packed(op, hidden.size(0), hidden, cu_seqlens, max_seqlen, Values::kCheck, "hidden's rows", reads);
}

PackedBatch prepare_packed_grad(const char* op, const Tensor& grad, int64_t tokens, const Tensor& cu_seqlens) {
  // The offsets' values are checked as a forward's are (on the CPU a loop over B + 1 values; on CUDA a few
  // device-side checks, no synchronisation): a backward op called directly with offsets that leave [0, T) would
  // otherwise write outside grad_hidden on CUDA, where the kernels take each text's rows from them.
  PackedBatch packed = prepare_packed(op, tokens, grad, cu_seqlens, std::nullopt, Values::kCheck, "seq_len");
  LMK_CHECK(
      packed.batch == grad.size(0), "lmk_ops.", op, ": expected grad_out with B = ", packed.batch,
      " texts (as cu_seqlens), got shape ", shape_str(grad.sizes()));
  return packed;
}

Tensor prepare_packed_mask(const char* op, const std::optional<Tensor>& mask, const PackedBatch& packed,
                           const Tensor& like, Values values) {
  if (!mask.has_value() || !mask->defined()) {
    return Tensor();
  }
  LMK_CHECK(
      mask->dim() == 1 && mask->size(0) == packed.tokens, "lmk_ops.", op,
      ": expected a packed mask of shape [T] = [", packed.tokens, "], got ", shape_str(mask->sizes()));
  check_mask_device(op, *mask, like);
  return mask_as_bool(op, *mask, values);
}

Tensor check_packed_positions(const char* op, const Tensor& positions, const PackedBatch& packed, const Tensor& like,
                              Values values) {
  // Shape, dtype and device as for the padded positions; the range is each text's own length.
  const Tensor p = prepare_positions(op, positions, packed.batch, std::numeric_limits<int64_t>::max(), like,
                                     Values::kTrusted);
  if (values == Values::kCheck && p.numel() > 0) {  // -1 or below the text's length
    kernels_for(like).check_range(
        p, -1, std::numeric_limits<int64_t>::max(), packed.lengths,
        message(op, "expected landmark positions in [0, length of their text) (counted from the text's start in "
                    "cu_seqlens) or -1 for none"),
        EntryName::kLandmarks);
  }
  return p;
}

Tensor prepare_packed_positions(const char* op, const Tensor& positions, const PackedBatch& packed,
                                const Tensor& like, Values values) {
  return packed.absolute(check_packed_positions(op, positions, packed, like, values));
}

Tensor prepare_packed_landmark_mask(const char* op, const Tensor& landmarks, const PackedBatch& packed,
                                    const Tensor& like) {
  check_landmarks_device(op, landmarks, like);
  LMK_CHECK(
      landmarks.dim() == 1 && landmarks.size(0) == packed.tokens, "lmk_ops.", op,
      ": expected a packed landmark mask of shape [T] = [", packed.tokens, "], got ", shape_str(landmarks.sizes()));
  return as_contiguous(landmarks);
}

RowSelection prepare_packed_landmarks(const char* op, const Tensor& landmarks, const PackedBatch& packed,
                                      const Tensor& like, Values values) {
  LMK_CHECK(
      landmarks.scalar_type() == ScalarType::Bool || landmarks.scalar_type() == ScalarType::Long, "lmk_ops.", op,
      ": expected packed landmarks as a bool mask [T] or int64 positions [B, K] padded with -1, got ",
      landmarks.scalar_type());
  if (landmarks.scalar_type() == ScalarType::Long) {
    return {Tensor(), prepare_packed_positions(op, landmarks, packed, like, values)};
  }
  return packed.selection(prepare_packed_landmark_mask(op, landmarks, packed, like));
}

}  // namespace lmk_ops
