// first_token_pool and last_token_pool as one op, token_pool, for every device and both layouts: find each text's
// first (or last) valid row, copy it out. The backward is landmark_gather_backward at the returned positions.
#include <optional>
#include <tuple>

#include "common/checks.h"
#include "common/packed.h"
#include "common/tensor_ops.h"
#include "ops/kernels.h"
#include "ops/op_entry.h"

namespace lmk_ops::ops {
namespace {

// Each text's first (or last) valid row, as a [B, 1] column of positions from the text's start; -1 for a text with
// none. The texts are a packed batch's runs of rows (offsets), or a padded batch's of seq_len rows where offsets is
// undefined; valid: bool over the rows (undefined: every row). One pass on every device.
Tensor find_rows(const Tensor& like, const Tensor& valid, const Tensor& offsets, int64_t batch, int64_t seq_len,
                 bool last) {
  Tensor positions = empty_on(like, {batch, 1}, ScalarType::Long);
  Tensor no_counts;
  kernels_for(like).find_rows(valid, offsets, batch, seq_len, last, positions, no_counts);
  return positions;
}

std::tuple<Tensor, Tensor> token_pool(const Tensor& hidden, const std::optional<Tensor>& mask, bool last,
                                      const std::optional<Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen) {
  const char* op = last ? "last_token_pool" : "first_token_pool";
  Tensor positions, starts;  // starts: a packed batch's offsets, which the gather adds to the positions
  int64_t batch = 0;
  if (cu_seqlens.has_value()) {
    const PackedBatch packed = prepare_packed_hidden(op, hidden, *cu_seqlens, max_seqlen, PackedReads::kGivenOffsets);
    const Tensor valid = prepare_packed_mask(op, mask, packed, hidden);
    positions = find_rows(hidden, valid, packed.offsets, packed.batch, 0, last);
    starts = packed.offsets;
    batch = packed.batch;
  } else {
    check_hidden(op, hidden, max_seqlen);
    batch = hidden.size(0);
    const int64_t seq_len = hidden.size(1);
    positions = find_rows(hidden, prepare_mask(op, mask, batch, seq_len, hidden), Tensor(), batch, seq_len, last);
  }
  // The output is a tensor of its own, not a view: autograd refuses in-place changes (emb /= norm) to a view made
  // inside an op. The gather writes it as [B, 1, D].
  const int64_t dim = hidden.size(hidden.dim() - 1);
  Tensor out = empty_on(hidden, {batch, dim}, hidden.scalar_type());
  if (out.numel() > 0) {
    Tensor one_row_each = torch::stable::view(out, {batch, 1, dim});
    kernels_for(hidden).gather_forward(hidden, positions, starts, one_row_each);
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
