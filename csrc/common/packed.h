#pragma once
// Packed (variable-length) batches: hidden [T, D] with offsets cu_seqlens [B + 1], as flash-attention's varlen
// kernels, transformers' DataCollatorWithFlattening and sentence-transformers' flattened path carry them.
//
// The kernels never see a layout, only each text's ordered list of selected rows (common/kernel_types.h). A
// packed batch becomes the padded kernels' input with no copy: hidden viewed as [B, T, D] with a batch stride of 0
// (every text sees all T rows) and each text's rows given as a run of absolute row numbers (with a mask, the run's
// rows where it is true). The kernels then walk the same rows in the same order as for the padded batch, so a text
// pools to the same bits in either layout.
#include <optional>

#include "common/checks.h"
#include "common/tensor_ops.h"

namespace lmk_ops {

struct PackedBatch {
  Tensor offsets;  // cu_seqlens as int64 [B + 1], contiguous: its first B entries are the texts' starts (with
                   // PackedReads::kGivenOffsets, cu_seqlens itself where it is contiguous, int32 or int64, which
                   // only find_rows and gather_forward take: not the methods below nor the other kernels)
  Tensor lengths;  // [B]: offsets[1:] - offsets[:-1], contiguous (undefined but with PackedReads::kLengths)
  int64_t batch = 0;
  int64_t tokens = 0;  // T

  // hidden [T, D] as [B, T, D] with batch stride 0: the input of the padded kernels for absolute row lists.
  Tensor batch_view(const Tensor& hidden) const;
  // Positions counted from each text's start ([B, K] int32 or int64, -1 padded) as absolute rows of hidden (-1
  // stays -1), a new contiguous tensor in their dtype.
  Tensor absolute(const Tensor& positions) const;
  // Absolute rows of hidden ([B, K] int32 or int64, -1 padded, contiguous) counted from each text's start again.
  // rows must be the caller's own (a kernel's fresh output): it is rewritten in place.
  Tensor relative(Tensor rows) const;
  // The rows the forward kernels reduce, for the [B, T, D] batch view: where selected [T] (bool) is true, every row
  // of each text when it is undefined; as runs with selected as their mask (kernel_types.h), which the kernels list
  // in as many entries as rows are selected.
  RowSelection selection(const Tensor& selected) const;
};

// Validates cu_seqlens for T rows on like's device: int32 or int64 [B + 1], first 0, last T, non-decreasing; and
// max_seqlen, when given, at least every text's length. Values are checked as prepare_mask checks them (on CUDA
// without a host synchronisation). tokens_are: what T is, for the message of a wrong last offset.
// reads: what the op's kernels read, so that a small call allocates no more than it needs (an allocation is a
// measurable share of one): kLengths, the int64 offsets and the lengths; kOffsets, the int64 offsets only;
// kGivenOffsets, the offsets only, through find_rows and gather_forward, which take cu_seqlens as it is where it is
// contiguous (OffsetsView).
enum class PackedReads { kLengths, kOffsets, kGivenOffsets };
PackedBatch prepare_packed(const char* op, int64_t tokens, const Tensor& like, const Tensor& cu_seqlens,
                           std::optional<int64_t> max_seqlen, Values values = Values::kCheck,
                           const char* tokens_are = "hidden's rows", PackedReads reads = PackedReads::kLengths);

// hidden [T, D] (checked as check_packed_hidden does) and its cu_seqlens, checked as prepare_packed does.
PackedBatch prepare_packed_hidden(const char* op, const Tensor& hidden, const Tensor& cu_seqlens,
                                  std::optional<int64_t> max_seqlen, PackedReads reads = PackedReads::kLengths);

// The packed batch of a backward op, its cu_seqlens checked as prepare_packed checks them (without max_seqlen);
// grad_out's first dimension must be B.
PackedBatch prepare_packed_grad(const char* op, const Tensor& grad, int64_t tokens, const Tensor& cu_seqlens);

// A packed batch's token mask [T] (bool, or integer 0/1), as a contiguous bool tensor; undefined when not given.
Tensor prepare_packed_mask(const char* op, const std::optional<Tensor>& mask, const PackedBatch& packed,
                               const Tensor& like, Values values = Values::kCheck);

// A packed batch's landmarks as the kernels take them: a bool [T] mask becomes absolute row lists; int64 positions
// [B, K] counted from each text's start (-1 padded) are checked against each text's length and made absolute.
RowSelection prepare_packed_landmarks(const char* op, const Tensor& landmarks, const PackedBatch& packed,
                                      const Tensor& like, Values values = Values::kCheck);

// A packed landmark mask: bool [T] on like's device (dtype checked by the caller); returned contiguous.
Tensor prepare_packed_landmark_mask(const char* op, const Tensor& landmarks, const PackedBatch& packed,
                                        const Tensor& like);

// Positions [B, K] counted from each text's start: int64, -1 or inside their own text; returned contiguous.
Tensor check_packed_positions(const char* op, const Tensor& positions, const PackedBatch& packed, const Tensor& like,
                              Values values = Values::kCheck);

// check_packed_positions, returned as absolute rows of hidden.
Tensor prepare_packed_positions(const char* op, const Tensor& positions, const PackedBatch& packed,
                                    const Tensor& like, Values values = Values::kCheck);

}  // namespace lmk_ops
