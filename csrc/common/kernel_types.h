#pragma once
// What the kernels take: PyTorch's stable-ABI tensors (torch::stable::Tensor), as the whole extension does. Kernels
// trust their inputs: the ops check them first. B, L, D > 0 unless a line says otherwise. Output tensors come
// allocated; kernels write their elements.
#include <torch/csrc/stable/tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace lmk_ops {

// Sums and products of half, bfloat16 and float run in float; of double in double.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// The divisor's floor when pooled rows are normalised, as torch.nn.functional.normalize's eps.
constexpr double kNormalizeEps = 1e-12;

// Room for a value check's "expected ..." text (check_range's, OffsetChecks::message's), its terminating zero
// included: the CUDA kernels take the text by value, as a kernel argument, to print it. A CPU twin build checks that
// every text fits (common/host_path.h).
constexpr std::size_t kDeviceMessageBytes = 512;

// Which rows of each text an op reduces; produced by the input checks, consumed by the kernels. Every row (all
// undefined), the rows where a contiguous bool [B, L] mask is true, the rows listed in contiguous int64 [B, K]
// positions (-1 entries skipped; the others checked to lie in [0, L); a repeated position counts as often as it is
// listed), or runs: text b's rows are [offsets[b], offsets[b] + lengths[b]) (contiguous int64 [B + 1] and [B]; a
// packed batch's texts), every row of them, or with mask a contiguous bool [T], the rows where it is true. (Not a
// [B, K] list of a packed batch's rows: that takes B times the longest text's room.)
using Tensor = torch::stable::Tensor;

struct RowSelection {
  Tensor mask = Tensor();
  Tensor positions = Tensor();
  Tensor lengths = Tensor();
  Tensor offsets = Tensor();  // with runs: the texts' bounds, starts and then the last text's end (int64 [B + 1])
};

#if defined(__CUDACC__)
#define LMK_HOST_DEVICE __host__ __device__
#else
#define LMK_HOST_DEVICE
#endif

// A packed batch's offsets [B + 1] as find_rows and gather_forward read them: int32 or int64, contiguous, the dtype
// the caller gave its cu_seqlens in (PackedReads::kGivenOffsets, common/packed.h), so that a small call converts
// nothing. Null data: no offsets (a padded batch).
struct OffsetsView {
  const void* data = nullptr;
  bool wide = true;  // int64; else int32

  explicit OffsetsView(const Tensor& offsets)
      : data(offsets.defined() ? offsets.const_data_ptr() : nullptr),
        wide(!offsets.defined() || offsets.scalar_type() == torch::headeronly::ScalarType::Long) {}
  LMK_HOST_DEVICE explicit operator bool() const {
    return data != nullptr;
  }
  LMK_HOST_DEVICE int64_t operator[](int64_t b) const {
    return wide ? static_cast<const int64_t*>(data)[b] : static_cast<const int32_t*>(data)[b];
  }
};

// The rows attention pooling reads and writes. Padded: listed.mask is the valid mask [B, L] (undefined: every row),
// valid the same. Packed (hidden a [B, T, D] view with batch stride 0, common/packed.h): listed lists each text's
// valid rows as absolute rows, valid marks the valid rows [T] (undefined: all), and the per-row tensors (weights
// [H, T], grad_weights [H, T], grad_hidden [T, D]) have no batch dimension; a row's text is the b with
// listed.offsets[b] <= row < listed.offsets[b + 1].
struct AttentionRows {
  RowSelection listed;
  Tensor valid;

  bool packed() const {
    return listed.offsets.defined();  // a packed batch's texts are runs of rows (PackedBatch::selection)
  }
};

// How check_range names the first bad value after "<expected>, got V": " at [r, c]" (" at [i]" for values [n]),
// " in row r (landmarks[r, c])", " in row i" (values [n], one per text), or nothing where the message names the one
// entry checked ("cu_seqlens[0]").
enum class EntryName { kIndex, kLandmarks, kRow, kNone };

// What a packed batch's offsets must hold (packed_offsets), in the order they are checked: cu_seqlens[0] = 0,
// cu_seqlens[B] = tokens, every text's length cu_seqlens[b + 1] - cu_seqlens[b] >= 0 and at most longest.
enum class OffsetCheck { kFirst, kLast, kOrder, kLongest };
// How many there are: the CUDA kernel carries, and the CPU twin measures, one message for each.
inline constexpr int kOffsetChecks = static_cast<int>(OffsetCheck::kLongest) + 1;
struct OffsetChecks {
  const char* op;
  const char* tokens_are;  // what T is, for the message of a wrong last offset
  int64_t tokens;
  int64_t longest;  // INT64_MAX: no bound

  // "lmk_ops.<op>: expected ..." for a failed check (common/packed.cpp); ", got V" follows, and for the lengths'
  // checks " at [b]".
  std::string message(OffsetCheck check) const;
};

// The kernel table of one device (for the CPU, of one capability).
struct Kernels {
  // Checks that every value of int64 values [rows, cols] or [n] (contiguous) lies in [lo, hi] and, where
  // row_limits (int64 [rows], contiguous) is defined, below its row's limit. Else "<expected>, got V" and the
  // entry, named as `naming` says, for the first value outside: raised at once on the CPU, and on CUDA printed by a
  // device-side assertion, without synchronising.
  void (*check_range)(const Tensor& values, int64_t lo, int64_t hi, const Tensor& row_limits,
                      const std::string& expected, EntryName naming);
  // hidden [B, L, D] with any strides; out [B, D] contiguous, in hidden's dtype or in its accumulation type
  // (float32, float64 for float64), which keeps the mean unrounded for a normalisation that follows.
  void (*mean_forward)(const Tensor& hidden, const RowSelection& rows, Tensor& out);
  // As mean_forward with out in hidden's dtype, plus argmax [B, D] contiguous int32 (-1 for a text with no row).
  void (*max_forward)(const Tensor& hidden, const RowSelection& rows, Tensor& out, Tensor& argmax);
  // The operand of the mean's backward: scaled [B, D] (contiguous, float32 or float64) = grad [B, D] (any strides, a
  // float dtype) / max(n_b, 1), in scaled's type with n_b rounded to it, where n_b is how many rows text b selects:
  // counts[b] (int64 [B]) where counts is defined, else row b's true entries of mask (bool [B, L]; with offsets, a
  // packed batch's int64 [B + 1], mask is [T] and text b's entries are [offsets[b], offsets[b + 1])), else row b's
  // entries >= 0 of positions (int64 [B, K]), else seq_len (contiguous tensors).
  void (*grad_over_counts)(const Tensor& grad, const Tensor& counts, const Tensor& mask, const Tensor& offsets,
                           const Tensor& positions, int64_t seq_len, Tensor& scaled);
  // scaled [B, D] contiguous in the accumulation type of grad_hidden's dtype (the gradient divided by each text's
  // row count); grad_hidden [B, L, D] contiguous, every row written: scaled[b] times how often the row is selected.
  // For runs (rows.offsets defined: a packed batch of T rows), grad_hidden is [1, T, D], each row takes its own
  // text's scaled row, and rows.mask is [T] or rows.positions [1, N] absolute rows (or neither: every row once).
  void (*mean_backward)(const Tensor& scaled, const RowSelection& rows, Tensor& grad_hidden);
  // grad [B, D] contiguous, argmax [B, D] contiguous int32 (positions from each text's start, -1 for none);
  // grad_hidden [B, L, D] contiguous, every row written: grad[b, d] where argmax[b, d] is the row's position, else 0.
  // With offsets (a packed batch's [B + 1] int64, contiguous; else undefined), grad_hidden is [1, T, D] and row t is
  // text b's position t - offsets[b], where offsets[b] <= t < offsets[b + 1].
  void (*max_backward)(const Tensor& grad, const Tensor& argmax, const Tensor& offsets, Tensor& grad_hidden);
  // positions [B, K] contiguous int64 (-1 or in [0, L)); out [B, K, D] contiguous, zero rows for -1. K may be 0.
  // hidden is [B, L, D] (starts undefined), or a packed batch's [T, D] with starts its offsets (int32 or int64
  // [B + 1], contiguous: OffsetsView), positions then counted from each text's start: text b's position l is row
  // starts[b] + l. (A [B, T, D] view and absolute rows would each cost a small call as much as an allocation.)
  void (*gather_forward)(const Tensor& hidden, const Tensor& positions, const Tensor& starts, Tensor& out);
  // grad [B, K, D] contiguous; every row of grad_hidden [B, L, D] (contiguous) written: the sum of the grad rows
  // listing it, in k order in the accumulation type, rounded once (zero when none does).
  void (*gather_backward)(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden);
  // Attention pooling. hidden [B, L, D] with any strides; rows as AttentionRows says (bool tensors contiguous);
  // query [H, D / H] contiguous in the accumulation type. Writes every element of out [B, D] (hidden's dtype), the
  // softmax statistics stats [B, H, 2] (float64 {max score, sum of exp(score - max)}) of every text, {-inf, -inf}
  // for a text with no valid row, and, when weights ([B, H, L], packed [H, T]; accumulation type, zero-filled,
  // contiguous) is defined, the probabilities of the valid rows.
  void (*attention_forward)(const Tensor& hidden, const AttentionRows& rows, const Tensor& query,
                            double scale, Tensor& out, Tensor& stats, Tensor& weights);
  // grad [B, D], grad_weights (shaped as the weights, or undefined) and out [B, D] (the forward's output)
  // contiguous in the accumulation type; stats as the forward wrote them. Writes every element of grad_hidden
  // ([B, L, D], packed [T, D]; hidden's dtype, contiguous) and of grad_query [H, D / H] (accumulation type).
  void (*attention_backward)(const Tensor& grad, const Tensor& grad_weights, const Tensor& hidden,
                             const AttentionRows& rows, const Tensor& query, const Tensor& out,
                             const Tensor& stats, double scale, Tensor& grad_hidden, Tensor& grad_query);
  // The valid rows of each text, for first/last-token pooling and landmark positions. The B texts are a packed batch's
  // runs of rows [offsets[b], offsets[b + 1]) (offsets int32 or int64 [B + 1], contiguous), or where offsets is
  // undefined a padded batch's, [b * seq_len, (b + 1) * seq_len). valid: bool over the rows, contiguous, or undefined
  // for every row. Writes positions, int64 [B, K] contiguous (K >= 0): each text's first K valid rows in order (with
  // last, its last K, the last first) as positions from the text's start, -1 past its valid rows; counts (int64 [B], or
  // undefined) how many valid rows each text has. B may be 0. Without counts a text's scan stops at its K-th valid row
  // (the usual text starts with a valid token).
  void (*find_rows)(const Tensor& valid, const Tensor& offsets, int64_t batch, int64_t seq_len, bool last,
                    Tensor& positions, Tensor& counts);
  // Row numbers moved between a text's own and the batch's: values [B, W] contiguous, int32 or int64; starts int64
  // [B] (or longer). out (values' dtype and shape, contiguous; may be values itself) = values + sign * starts[b]
  // where values >= 0, else -1. One pass: ATen's integer subtraction through the stable ABI is four kernels (it
  // goes by float64).
  void (*shift_rows)(const Tensor& values, const Tensor& starts, int64_t sign, Tensor& out);
  // A packed batch's cu_seqlens [B + 1] (int32 or int64, any stride) as int64 offsets [B + 1] (whose first B entries
  // are the texts' starts) and lengths [B] (offsets[b + 1] - offsets[b]), both contiguous, each unless undefined (the
  // checks alone); B may be 0. With checks (else null), the first check that fails (OffsetChecks' order, then the
  // lowest b) is "<its message>, got V": raised at once on the CPU, on CUDA printed by a device-side assertion, without
  // synchronising. One pass, where the cast, the differences and a check_range per condition took some eight kernel
  // launches on CUDA.
  void (*packed_offsets)(const Tensor& cu_seqlens, const OffsetChecks* checks, Tensor& offsets, Tensor& lengths);
  // out [B, D] (a float dtype, contiguous) = each row of wide [B, D] (its accumulation type, contiguous) divided by
  // max(its L2 norm, kNormalizeEps), as F.normalize (a NaN anywhere in a row makes all of it NaN). CPU only (null
  // in the CUDA table): the op layer's host path; a CUDA build normalises with tensor operations (ops/pooling.cpp).
  void (*normalize_rows)(const Tensor& wide, Tensor& out);
};

}  // namespace lmk_ops
