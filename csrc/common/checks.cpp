#include "common/checks.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "common/device_name.h"
#include "common/error.h"
#include "ops/kernels.h"

namespace lmk_ops {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s << (i ? ", " : "") << sizes[i];
  }
  s << "]";
  return s.str();
}

static bool is_supported_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// hidden of `dims` dimensions (the layout named by `shape` in messages) and a supported floating dtype.
static void check_hidden_layout(const char* op, const at::Tensor& hidden, int64_t dims, const char* shape) {
  LMK_CHECK(hidden.defined(), "lmk_ops.", op, ": expected hidden to be a tensor, got None");
  LMK_CHECK(
      hidden.dim() == dims, "lmk_ops.", op, ": expected ", shape, ", got a ", hidden.dim(), "-D tensor of shape ",
      shape_str(hidden.sizes()));
  LMK_CHECK(
      is_supported_float(hidden.scalar_type()), "lmk_ops.", op,
      ": expected hidden of dtype float16, bfloat16, float32 or float64, got ", hidden.scalar_type());
}

void check_hidden(const char* op, const at::Tensor& hidden) {
  check_hidden_layout(op, hidden, 3, "hidden of shape [B, L, D] (3-D)");
}

void check_packed_hidden(const char* op, const at::Tensor& hidden) {
  check_hidden_layout(op, hidden, 2, "packed hidden of shape [T, D] (2-D, with cu_seqlens)");
}

void check_grad(const char* op, const at::Tensor& grad, int64_t dims, const char* shape) {
  LMK_CHECK(
      grad.dim() == dims, "lmk_ops.", op, ": expected grad_out of shape ", shape, " (", dims, "-D), got shape ",
      shape_str(grad.sizes()));
  LMK_CHECK(
      is_supported_float(grad.scalar_type()), "lmk_ops.", op,
      ": expected grad_out of dtype float16, bfloat16, float32 or float64, got ", grad.scalar_type());
}

void check_grad_dtype(const char* op, std::optional<at::ScalarType> dtype) {
  LMK_CHECK(
      !dtype.has_value() || is_supported_float(*dtype), "lmk_ops.", op,
      ": expected dtype float16, bfloat16, float32 or float64, got ", *dtype);
}

at::Tensor prepare_mask(
    const char* op,
    const std::optional<at::Tensor>& mask,
    int64_t batch,
    int64_t seq_len,
    const at::Tensor& like,
    Values values) {
  if (!mask.has_value() || !mask->defined()) {
    return at::Tensor();
  }
  const at::Tensor& m = *mask;
  LMK_CHECK(
      m.device() == like.device(), "lmk_ops.", op, ": expected mask on the same device as hidden (", device_name(like),
      "), got ", device_name(m));
  LMK_CHECK(
      m.dim() == 2 && m.size(0) == batch && m.size(1) == seq_len, "lmk_ops.", op, ": expected mask of shape [B, L] = [",
      batch, ", ", seq_len, "], got ", shape_str(m.sizes()));
  const auto t = m.scalar_type();
  LMK_CHECK(
      t == at::kBool || at::isIntegralType(t, /*includeBool=*/false), "lmk_ops.", op,
      ": expected mask of dtype bool or an integer dtype holding 0/1, got ", t);
  if (t == at::kBool) {
    return m.contiguous();
  }
  // An integer mask is a Hugging Face attention_mask: anything but 0/1 is almost surely a mistake (weights, or
  // token ids passed by accident), so say so instead of treating it as "nonzero = valid".
  if (values == Values::kCheck) {
    kernels_for(m).check_range(
        m.to(at::kLong).contiguous(), 0, 1, std::string("lmk_ops.") + op + ": expected mask values 0 or 1",
        /*landmarks=*/false);
  }
  return m.ne(0).contiguous();
}

void check_landmarks_device(const char* op, const at::Tensor& landmarks, const at::Tensor& like) {
  LMK_CHECK(
      landmarks.device() == like.device(), "lmk_ops.", op, ": expected landmarks on the same device as hidden (",
      device_name(like), "), got ", device_name(landmarks));
}

at::Tensor prepare_positions(
    const char* op,
    const at::Tensor& positions,
    int64_t batch,
    int64_t seq_len,
    const at::Tensor& like,
    Values values) {
  check_landmarks_device(op, positions, like);
  LMK_CHECK(
      positions.scalar_type() == at::kLong, "lmk_ops.", op,
      ": expected landmark positions of dtype int64 (padded with -1), got ", positions.scalar_type());
  LMK_CHECK(
      positions.dim() == 2 && positions.size(0) == batch, "lmk_ops.", op,
      ": expected landmark positions of shape [B, K] = [", batch, ", K], got ", shape_str(positions.sizes()));
  at::Tensor p = positions.contiguous();
  // An out-of-range position would be a read outside hidden, so it is checked before any kernel runs.
  if (values == Values::kCheck) {
    std::ostringstream expected;
    expected << "lmk_ops." << op << ": expected landmark positions in [0, L) = [0, " << seq_len
             << ") or -1 for none";
    kernels_for(p).check_range(p, -1, seq_len - 1, expected.str(), /*landmarks=*/true);
  }
  return p;
}

RowSelection prepare_landmarks(
    const char* op,
    const at::Tensor& landmarks,
    int64_t batch,
    int64_t seq_len,
    const at::Tensor& like,
    Values values) {
  LMK_CHECK(
      landmarks.scalar_type() == at::kBool || landmarks.scalar_type() == at::kLong, "lmk_ops.", op,
      ": expected landmarks as a bool mask [B, L] or int64 positions [B, K] padded with -1, got ",
      landmarks.scalar_type());
  if (landmarks.scalar_type() == at::kLong) {
    return {at::Tensor(), prepare_positions(op, landmarks, batch, seq_len, like, values)};
  }
  check_landmarks_device(op, landmarks, like);
  LMK_CHECK(
      landmarks.dim() == 2 && landmarks.size(0) == batch && landmarks.size(1) == seq_len, "lmk_ops.", op,
      ": expected a landmark mask of shape [B, L] = [", batch, ", ", seq_len, "], got ",
      shape_str(landmarks.sizes()));
  return {landmarks.contiguous(), at::Tensor()};
}

Heads check_query(const char* op, const at::Tensor& query, const at::Tensor& hidden) {
  const int64_t dim = hidden.size(2);
  LMK_CHECK(
      dim > 0, "lmk_ops.", op, ": expected hidden with D > 0 features (attention scores need them), got shape ",
      shape_str(hidden.sizes()));
  LMK_CHECK(query.defined(), "lmk_ops.", op, ": expected query to be a tensor, got None");
  LMK_CHECK(
      query.device() == hidden.device(), "lmk_ops.", op, ": expected query on the same device as hidden (",
      device_name(hidden), "), got ", device_name(query));
  LMK_CHECK(
      is_supported_float(query.scalar_type()), "lmk_ops.", op,
      ": expected query of dtype float16, bfloat16, float32 or float64, got ", query.scalar_type());
  const bool one_head = query.dim() == 1 && query.size(0) == dim;
  const bool heads = query.dim() == 2 && query.size(0) > 0 && query.size(0) * query.size(1) == dim;
  LMK_CHECK(
      one_head || heads, "lmk_ops.", op, ": expected query of shape [D] = [", dim,
      "] (one head) or [H, D / H] with H * (D / H) = ", dim, " (H heads), got ", shape_str(query.sizes()));
  return one_head ? Heads{1, dim} : Heads{query.size(0), query.size(1)};
}

double resolve_scale(const char* op, std::optional<double> scale, int64_t head_dim) {
  // The kernels score in float32 (for float32 and the half types): a scale beyond its range would be inf there.
  LMK_CHECK(
      !scale.has_value() || (std::isfinite(*scale) && std::abs(*scale) <= std::numeric_limits<float>::max()),
      "lmk_ops.", op, ": expected a scale finite in float32, got ", *scale);
  return scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

void check_float_tensor(
    const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape, const at::Tensor& like) {
  LMK_CHECK(t.defined(), "lmk_ops.", op, ": expected ", name, " to be a tensor, got None");
  LMK_CHECK(
      t.device() == like.device(), "lmk_ops.", op, ": expected ", name, " on the same device as hidden (",
      device_name(like), "), got ", device_name(t));
  LMK_CHECK(
      is_supported_float(t.scalar_type()) && t.sizes() == shape, "lmk_ops.", op, ": expected ", name,
      " of a floating dtype and shape ", shape_str(shape), ", got ", t.scalar_type(), " of shape ",
      shape_str(t.sizes()));
}

}  // namespace lmk_ops
