// CPU implementations of the landmark ops: landmark_mean (LMK pooling) and landmark_gather (one vector per
// landmark), with their backward ops.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/dispatch.h"
#include "cpu/pooling.h"

namespace lmk_ops::cpu {
namespace {

// The mean over the landmark rows only: the kernel reads those rows and nothing else, so the cost grows with the
// number of landmarks, not with L.
std::tuple<at::Tensor, at::Tensor> landmark_mean(const at::Tensor& hidden, const at::Tensor& landmarks, bool normalize) {
  constexpr const char* op = "landmark_mean";
  check_hidden(op, hidden);
  const RowSelection rows = prepare_landmarks(op, landmarks, hidden.size(0), hidden.size(1), hidden);
  return mean_of_rows(hidden, rows, normalize);
}

at::Tensor landmark_mean_backward(
    const at::Tensor& grad, const at::Tensor& landmarks, int64_t seq_len, std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "landmark_mean_backward";
  check_pooled_grad(op, grad);
  check_grad_dtype(op, dtype);
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  const RowSelection rows = prepare_landmarks(op, landmarks, grad.size(0), seq_len, grad);
  return mean_of_rows_backward(grad, rows, seq_len, dtype);
}

// out[b, k] = hidden[b, positions[b, k]], zeros where the position is -1. Split over (b, k) rows: each output row
// is written once (a memcpy when hidden's features are contiguous).
template <typename scalar_t>
void gather_rows(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out) {
  const int64_t listed = positions.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const int64_t* p = positions.const_data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, dim));
  at::parallel_for(0, out.size(0) * listed, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t l = p[row];
      scalar_t* dst = o + row * dim;
      if (l < 0) {
        std::memset(dst, 0, dim * sizeof(scalar_t));
        continue;
      }
      const scalar_t* src = h + (row / listed) * sb + l * sl;
      if (sd == 1) {
        std::memcpy(dst, src, dim * sizeof(scalar_t));
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          dst[d] = src[d * sd];
        }
      }
    }
  });
}

at::Tensor landmark_gather(const at::Tensor& hidden, const at::Tensor& positions) {
  constexpr const char* op = "landmark_gather";
  check_hidden(op, hidden);
  const at::Tensor p = prepare_positions(op, positions, hidden.size(0), hidden.size(1), hidden);
  at::Tensor out = at::empty({hidden.size(0), p.size(1), hidden.size(2)}, hidden.options());
  if (out.numel() > 0) {
    LMK_DISPATCH_FLOATING(hidden.scalar_type(), "landmark_gather", [&] { gather_rows<scalar_t>(hidden, p, out); });
  }
  return out;
}

// grad_hidden[b, l] = the sum of grad[b, k] over the k listing position l (rows nobody lists stay zero). Split over
// texts. A row listed once is a copy; a repeated position's gradients are summed in k order in the accumulation
// type and rounded once, so the result is deterministic and as exact as one rounding allows.
template <typename scalar_t>
void scatter_rows(const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden) {
  using acc = at::opmath_type<scalar_t>;
  const int64_t listed = positions.size(1), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const int64_t* p = positions.const_data_ptr<int64_t>();
  scalar_t* out = grad_hidden.data_ptr<scalar_t>();
  at::parallel_for(0, grad_hidden.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> rows;  // (l, k), grouped by l with k increasing
    std::vector<acc> sum(dim);
    for (int64_t b = begin; b < end; ++b) {
      rows.clear();
      for (int64_t k = 0; k < listed; ++k) {
        if (p[b * listed + k] >= 0) {
          rows.emplace_back(p[b * listed + k], k);
        }
      }
      std::sort(rows.begin(), rows.end());
      for (size_t first = 0, last; first < rows.size(); first = last) {
        for (last = first + 1; last < rows.size() && rows[last].first == rows[first].first; ++last) {
        }
        scalar_t* dst = out + (b * seq_len + rows[first].first) * dim;
        const scalar_t* src = g + (b * listed + rows[first].second) * dim;
        if (last - first == 1) {
          std::memcpy(dst, src, dim * sizeof(scalar_t));
          continue;
        }
        std::fill(sum.begin(), sum.end(), acc(0));
        for (size_t i = first; i < last; ++i) {
          const scalar_t* row = g + (b * listed + rows[i].second) * dim;
          for (int64_t d = 0; d < dim; ++d) {
            sum[d] += static_cast<acc>(row[d]);
          }
        }
        for (int64_t d = 0; d < dim; ++d) {
          dst[d] = static_cast<scalar_t>(sum[d]);
        }
      }
    }
  });
}

at::Tensor landmark_gather_backward(const at::Tensor& grad, const at::Tensor& positions, int64_t seq_len) {
  constexpr const char* op = "landmark_gather_backward";
  check_grad(op, grad, 3, "[B, K, D]");
  TORCH_CHECK(seq_len >= 0, "lmk_ops.", op, ": expected seq_len >= 0, got ", seq_len);
  const at::Tensor p = prepare_positions(op, positions, grad.size(0), seq_len, grad);
  TORCH_CHECK(
      p.size(1) == grad.size(1), "lmk_ops.", op, ": expected grad_out of shape [B, K, D] with K = ", p.size(1),
      " (as positions), got ", shape_str(grad.sizes()));
  // Zero-filled first: most rows are not landmarks, and a memset of the whole gradient is the cheapest way to
  // write them.
  at::Tensor grad_hidden = at::zeros({grad.size(0), seq_len, grad.size(2)}, grad.options());
  if (grad.numel() > 0) {
    const at::Tensor g = grad.contiguous();
    LMK_DISPATCH_FLOATING(grad.scalar_type(), "landmark_gather_backward", [&] {
      scatter_rows<scalar_t>(g, p, grad_hidden);
    });
  }
  return grad_hidden;
}

}  // namespace

TORCH_LIBRARY_IMPL(lmk_ops, CPU, m) {
  m.impl("landmark_mean", &landmark_mean);
  m.impl("landmark_mean_backward", &landmark_mean_backward);
  m.impl("landmark_gather", &landmark_gather);
  m.impl("landmark_gather_backward", &landmark_gather_backward);
}

}  // namespace lmk_ops::cpu
