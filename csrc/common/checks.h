#pragma once
// Input checks shared by every op. Each message starts with "lmk_ops.<op>:" and says what was expected and
// what came, so a user can fix the call without reading this code.
#include <optional>
#include <string>

#include "common/tensor_ops.h"

namespace lmk_ops {

// hidden: a [B, L, D] tensor of float16, bfloat16, float32 or float64 (any strides); max_seqlen, which only a
// packed batch takes, absent.
void check_hidden(const char* op, const Tensor& hidden, std::optional<int64_t> max_seqlen = std::nullopt);

// hidden: the same, [T, D], for a packed batch.
void check_packed_hidden(const char* op, const Tensor& hidden);

// grad: a floating tensor of the given number of dimensions, named by shape ("[B, D]") in messages.
void check_grad(const char* op, const Tensor& grad, int64_t dims, const char* shape);

// grad: a [B, D] floating tensor (the gradient of a pooled output).
inline void check_pooled_grad(const char* op, const Tensor& grad) {
  check_grad(op, grad, 2, "[B, D]");
}

// dtype, when given: the floating dtype a backward op returns its gradient in.
void check_grad_dtype(const char* op, std::optional<ScalarType> dtype);

// Whether the values of a mask or of positions are checked (forward ops) or trusted (backward ops, which get what
// their forward checked). Shapes, dtypes and devices are always checked. Value checks never synchronise with a GPU:
// on the CPU they raise at once; on CUDA a device-side check prints the same message and stops the stream (the
// host sees "device-side assert triggered" at its next synchronisation), so the ops can be captured in CUDA graphs.
enum class Values { kCheck, kTrusted };

// Validates an attention mask against [batch, seq_len] and like's device. Accepts bool or integer tensors whose
// values are 0 or 1 (a Hugging Face attention_mask). Returns it as a contiguous bool tensor, or an undefined tensor
// when no mask was given (every token valid). Errors name op and the argument as name.
Tensor prepare_mask(
    const char* op,
    const std::optional<Tensor>& mask,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values = Values::kCheck,
    const char* name = "mask");

// A mask of any shape (the checks of shape are the caller's) as a contiguous bool tensor of that shape: its dtype
// bool or integer, an integer one's values 0/1 (a bad one is reported at its index in mask's own shape).
Tensor mask_as_bool(const char* op, const Tensor& mask, Values values, const char* name = "mask");
void check_mask_device(const char* op, const Tensor& mask, const Tensor& like, const char* name = "mask");

// Validates landmarks against [batch, seq_len] and like's device: a bool mask [B, L], or int64 positions [B, K]
// holding -1 (no landmark) or a position in [0, seq_len). Returns the one that was given, contiguous.
RowSelection prepare_landmarks(
    const char* op,
    const Tensor& landmarks,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values = Values::kCheck);

// Landmarks (a mask or positions) on like's device.
void check_landmarks_device(const char* op, const Tensor& landmarks, const Tensor& like);

// Validates int64 positions [batch, K] holding -1 or a position in [0, seq_len); returns them contiguous.
Tensor prepare_positions(
    const char* op,
    const Tensor& positions,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values = Values::kCheck);

// The heads of an attention query: count H and width D / H.
struct Heads {
  int64_t count;
  int64_t dim;
};

// query: [D] (one head) or [H, D / H] (H heads) of a floating dtype, on hidden's device, where hidden ([B, L, D],
// or packed [T, D]; checked) has D > 0 features.
Heads check_query(const char* op, const Tensor& query, const Tensor& hidden);

// The attention score scale: the given one, which must be finite, or 1 / sqrt(head_dim).
double resolve_scale(const char* op, std::optional<double> scale, int64_t head_dim);

// A floating tensor named `name` of exactly the expected shape, on like's device (saved tensors of backward ops).
void check_float_tensor(
    const char* op, const char* name, const Tensor& t, Sizes shape, const Tensor& like);

// "[2, 3, 4]" — for messages.
std::string shape_str(Sizes sizes);

}  // namespace lmk_ops
