#include "common/checks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "common/device_name.h"
#include "common/error.h"
#include "common/host_path.h"
#include "ops/kernels.h"

namespace lmk_ops {

std::string shape_str(Sizes sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s << (i ? ", " : "") << sizes[i];
  }
  s << "]";
  return s.str();
}

static bool is_supported_float(ScalarType t) {
  return t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Float || t == ScalarType::Double;
}

// hidden of `dims` dimensions (the layout named by `shape` in messages) and a supported floating dtype.
static void check_hidden_layout(const char* op, const Tensor& hidden, int64_t dims, const char* shape) {
  LMK_CHECK(hidden.defined(), "lmk_ops.", op, ": expected hidden to be a tensor, got None");
  LMK_CHECK(
      hidden.dim() == dims, "lmk_ops.", op, ": expected ", shape, ", got a ", hidden.dim(), "-D tensor of shape ",
      shape_str(hidden.sizes()));
  LMK_CHECK(
      is_supported_float(hidden.scalar_type()), "lmk_ops.", op,
      ": expected hidden of dtype float16, bfloat16, float32 or float64, got ", hidden.scalar_type());
}

void check_hidden(const char* op, const Tensor& hidden, std::optional<int64_t> max_seqlen) {
  check_hidden_layout(op, hidden, 3, "hidden of shape [B, L, D] (3-D)");
  // A hint for packed batches only: taken silently here, it would hide a call that forgot cu_seqlens.
  LMK_CHECK(
      !max_seqlen.has_value(), "lmk_ops.", op, ": expected max_seqlen only with cu_seqlens (a packed batch), got ",
      "max_seqlen = ", max_seqlen.value_or(0), " for a padded hidden of shape ", shape_str(hidden.sizes()));
}

void check_packed_hidden(const char* op, const Tensor& hidden) {
  check_hidden_layout(op, hidden, 2, "packed hidden of shape [T, D] (2-D, with cu_seqlens)");
}

void check_grad(const char* op, const Tensor& grad, int64_t dims, const char* shape) {
  LMK_CHECK(
      grad.dim() == dims, "lmk_ops.", op, ": expected grad_out of shape ", shape, " (", dims, "-D), got shape ",
      shape_str(grad.sizes()));
  LMK_CHECK(
      is_supported_float(grad.scalar_type()), "lmk_ops.", op,
      ": expected grad_out of dtype float16, bfloat16, float32 or float64, got ", grad.scalar_type());
}

void check_grad_dtype(const char* op, std::optional<ScalarType> dtype) {
  LMK_CHECK(
      !dtype.has_value() || is_supported_float(*dtype), "lmk_ops.", op,
      ": expected dtype float16, bfloat16, float32 or float64, got ", *dtype);
}

Tensor prepare_mask(
    const char* op,
    const std::optional<Tensor>& mask,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values,
    const char* name) {
  if (!mask.has_value() || !mask->defined()) {
    return Tensor();
  }
  const Tensor& m = *mask;
  check_mask_device(op, m, like, name);
  LMK_CHECK(
      m.dim() == 2 && m.size(0) == batch && m.size(1) == seq_len, "lmk_ops.", op, ": expected ", name,
      " of shape [B, L] = [", batch, ", ", seq_len, "], got ", shape_str(m.sizes()));
  return mask_as_bool(op, m, values, name);
}

void check_mask_device(const char* op, const Tensor& mask, const Tensor& like, const char* name) {
  LMK_CHECK(
      mask.device() == like.device(), "lmk_ops.", op, ": expected ", name, " on the same device as hidden (",
      device_name(like), "), got ", device_name(mask));
}

namespace {

// out[i] = v[i] != 0 for n values; returns whether any value is not 0 or 1. One branch-free pass, also compiled
// for AVX2 and chosen at load time where the CPU has it: this file is built for the x86-64 baseline, where the pass
// took ~0.45 ns a value, 58 us for a 64x2048 attention mask (a first_token_pool's own work is ~10 us). On a 2-core
// Intel Xeon, 10th percentile of 5000 calls of the valid_mask op: 32x512 8.1-8.2 -> 4.4 us, 64x2048 57-58 -> 22-27.
// (An AVX-512 clone was faster still, 3.6 and 15.5, but naming it needs GCC 12's "arch=x86-64-v4", which an older
// compiler on a build machine would reject.)
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
__attribute__((target_clones("avx2", "default")))
#endif
#endif
bool zero_one_as_bool(const int64_t* v, int64_t n, bool* out) {
  uint64_t outside = 0;  // bits above the lowest of any value
  for (int64_t i = 0; i < n; ++i) {
    outside |= static_cast<uint64_t>(v[i]) >> 1;
    out[i] = v[i] != 0;
  }
  return outside != 0;
}
}  // namespace

Tensor mask_as_bool(const char* op, const Tensor& m, Values values, const char* name) {
  const auto t = m.scalar_type();
  LMK_CHECK(
      t == ScalarType::Bool || is_integral(t), "lmk_ops.", op, ": expected ", name,
      " of dtype bool or an integer dtype holding 0/1, got ", t);
  if (t == ScalarType::Bool) {
    return as_contiguous(m);
  }
  // An integer mask is a Hugging Face attention_mask: anything but 0/1 is almost surely a mistake (weights, or
  // token ids passed by accident), so say so instead of treating it as "nonzero = valid".
  // The device's range check: raises on the CPU, a device-side assertion on CUDA (common/kernel_types.h).
  const auto check_values = [&](const Tensor& as_long) {
    const std::string expected = std::string("lmk_ops.") + op + ": expected " + name + " values 0 or 1";
    kernels_for(m).check_range(as_long, 0, 1, Tensor(), expected, EntryName::kIndex);
  };
  if (takes_host_path(m)) {  // one pass that checks and converts, where the generic form costs several operator calls
    const Tensor as_long = as_contiguous(to_dtype(m, ScalarType::Long));  // no copy for the usual int64 mask
    Tensor valid = empty_on(m, m.sizes(), ScalarType::Bool);
    const int64_t* v = as_long.const_data_ptr<int64_t>();
    const int64_t n = as_long.numel();
    if (zero_one_as_bool(v, n, valid.mutable_data_ptr<bool>()) && values == Values::kCheck) {
      check_values(as_long);  // raises, naming the first value outside and where it is
    }
    return valid;
  }
  if (values == Values::kCheck) {
    check_values(as_contiguous(to_dtype(m, ScalarType::Long)));
  }
  // A cast to bool is "nonzero", as ne(m, 0), in one kernel (ne's 0 is a 0-d tensor filled first: two).
  return as_contiguous(to_dtype(m, ScalarType::Bool));
}

void check_landmarks_device(const char* op, const Tensor& landmarks, const Tensor& like) {
  LMK_CHECK(
      landmarks.device() == like.device(), "lmk_ops.", op, ": expected landmarks on the same device as hidden (",
      device_name(like), "), got ", device_name(landmarks));
}

// An int64 [B, L] tensor (L >= 3) of 0s and 1s only is a landmark mask in the wrong dtype (made from input ids with
// .long(), or a tokenizer's special_tokens_mask), not positions: read as positions it would list rows 0 and 1 again
// and again, a silent wrong answer. It is refused like a bad value, without synchronising: its largest entry, taken
// as 2 where some entry is -1, must be at least 2. (Positions that list only rows 0 and 1, L >= 3 times, have no use;
// L = 2 stays ambiguous, and positions [B, 2] are taken.)
static void refuse_integer_mask(const char* op, const Tensor& positions) {
  Tensor key;
  if (takes_host_path(positions)) {  // stops at the first entry other than 0 and 1: positions' first, as a rule
    const int64_t* p = positions.const_data_ptr<int64_t>();
    const int64_t* other = std::find_if(p, p + positions.numel(), [](int64_t v) { return v != 0 && v != 1; });
    if (other != p + positions.numel()) {
      return;
    }
    key = full_on(positions, {1, 1}, static_cast<double>(*std::max_element(p, p + positions.numel())),
                  ScalarType::Long);
  } else {
    const std::vector<int64_t> all{0, 1};
    const Tensor largest = aten("aten::amax", "", positions, all, true);
    const Tensor smallest = aten("aten::amin", "", positions, all, true);
    key = where(ge(smallest, 0), largest, full_on(positions, {1, 1}, 2, ScalarType::Long));
  }
  std::ostringstream expected;
  expected << "lmk_ops." << op << ": landmarks is an int64 [B, L] = " << shape_str(positions.sizes())
           << " tensor of 0s and 1s: a landmark mask in the wrong dtype (pass landmarks.bool()), which read as "
              "positions would list rows 0 and 1 again and again; expected positions' largest entry to be at least "
              "2, or some entry -1";
  kernels_for(positions).check_range(key, 2, std::numeric_limits<int64_t>::max(), Tensor(), expected.str(),
                                     EntryName::kNone);
}

Tensor prepare_positions(
    const char* op,
    const Tensor& positions,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values) {
  check_landmarks_device(op, positions, like);
  LMK_CHECK(
      positions.scalar_type() == ScalarType::Long, "lmk_ops.", op,
      ": expected landmark positions of dtype int64 (padded with -1), got ", positions.scalar_type());
  LMK_CHECK(
      positions.dim() == 2 && positions.size(0) == batch, "lmk_ops.", op,
      ": expected landmark positions of shape [B, K] = [", batch, ", K], got ", shape_str(positions.sizes()));
  Tensor p = as_contiguous(positions);
  // An out-of-range position would be a read outside hidden, so it is checked before any kernel runs.
  if (values == Values::kCheck) {
    std::ostringstream expected;
    expected << "lmk_ops." << op << ": expected landmark positions in [0, L) = [0, " << seq_len
             << ") or -1 for none";
    kernels_for(p).check_range(p, -1, seq_len - 1, Tensor(), expected.str(), EntryName::kLandmarks);
    if (p.size(1) == seq_len && seq_len >= 3 && p.size(0) > 0) {
      refuse_integer_mask(op, p);
    }
  }
  return p;
}

RowSelection prepare_landmarks(
    const char* op,
    const Tensor& landmarks,
    int64_t batch,
    int64_t seq_len,
    const Tensor& like,
    Values values) {
  LMK_CHECK(
      landmarks.scalar_type() == ScalarType::Bool || landmarks.scalar_type() == ScalarType::Long, "lmk_ops.", op,
      ": expected landmarks as a bool mask [B, L] or int64 positions [B, K] padded with -1, got ",
      landmarks.scalar_type());
  if (landmarks.scalar_type() == ScalarType::Long) {
    return {Tensor(), prepare_positions(op, landmarks, batch, seq_len, like, values)};
  }
  check_landmarks_device(op, landmarks, like);
  LMK_CHECK(
      landmarks.dim() == 2 && landmarks.size(0) == batch && landmarks.size(1) == seq_len, "lmk_ops.", op,
      ": expected a landmark mask of shape [B, L] = [", batch, ", ", seq_len, "], got ",
      shape_str(landmarks.sizes()));
  return {as_contiguous(landmarks), Tensor()};
}

Heads check_query(const char* op, const Tensor& query, const Tensor& hidden) {
  const int64_t dim = hidden.size(hidden.dim() - 1);
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
    const char* op, const char* name, const Tensor& t, Sizes shape, const Tensor& like) {
  LMK_CHECK(t.defined(), "lmk_ops.", op, ": expected ", name, " to be a tensor, got None");
  LMK_CHECK(
      t.device() == like.device(), "lmk_ops.", op, ": expected ", name, " on the same device as hidden (",
      device_name(like), "), got ", device_name(t));
  LMK_CHECK(
      is_supported_float(t.scalar_type()) && same_sizes(t.sizes(), shape), "lmk_ops.", op, ": expected ", name,
      " of a floating dtype and shape ", shape_str(shape), ", got ", t.scalar_type(), " of shape ",
      shape_str(t.sizes()));
}

}  // namespace lmk_ops
