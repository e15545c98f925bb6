// Vectorised CPU kernels of attention pooling. Compiled once per CPU capability, like pool_kernels.cpp.
//
// Work split (forward and backward): tasks are (text b, block of whole heads), as for_each_text_block makes them:
// whole texts when B keeps every thread busy, blocks of heads when it does not. Each (text, head) result depends
// only on that text's valid rows, taken in order, so a text pools to the same bits alone or in a batch, whatever
// the padding side or the thread count.
//
// Forward, per text and head: one pass over the valid rows with an online softmax. Each group of rows gets its
// scores (dot with the head's query), the running maximum moves up if a score passes it (rescaling the running
// total and the weighted row sum once per group), then the rows are added with weight exp(score - max). Nothing
// can overflow: every exponent is <= 0. Only the log-sum-exp [B, H] is kept for the backward.
//
// Backward, per text and head: with p_l = exp(s_l - lse) and a_l = <g, x_l> (+ the gradient of the returned
// weight), the score gradient is p_l (a_l - delta) with delta = sum_l p_l a_l. One pass reads each valid row once
// and keeps p_l, a_l and the two row sums the query gradient needs (sum p_l a_l x_l and sum p_l x_l). The rows of
// grad_hidden, p_l g + scale p_l (a_l - delta) q, need no hidden state: a second loop writes every one of them
// (zeros for the padding) without reading hidden again.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/dispatch.h"
#include "cpu/attention_kernels.h"
#include "cpu/kernel_common.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {
namespace {

// out[k] = <x, ys[k]> over n features (feature i of x at x[i * stride]; ys contiguous). Four independent
// accumulator chains per vector hide the FMA latency.
template <int K, typename scalar_t>
inline void dots(const scalar_t* x, int64_t stride, const acc_t<scalar_t>* const* ys, int64_t n,
                 acc_t<scalar_t>* out) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  for (int k = 0; k < K; ++k) {
    out[k] = acc(0);
  }
  if (stride == 1) {
    Vec s[K][4];
    for (int k = 0; k < K; ++k) {
      for (int u = 0; u < 4; ++u) {
        s[k][u] = Vec(acc(0));
      }
    }
    for (; i + 4 * W <= n; i += 4 * W) {
      for (int u = 0; u < 4; ++u) {
        const Vec xv = load_widened(x + i + u * W);
        for (int k = 0; k < K; ++k) {
          s[k][u] = at::vec::fmadd(xv, Vec::loadu(ys[k] + i + u * W), s[k][u]);
        }
      }
    }
    for (; i + W <= n; i += W) {
      const Vec xv = load_widened(x + i);
      for (int k = 0; k < K; ++k) {
        s[k][0] = at::vec::fmadd(xv, Vec::loadu(ys[k] + i), s[k][0]);
      }
    }
    for (int k = 0; k < K; ++k) {
      out[k] = at::vec::vec_reduce_all<acc>(
          [](Vec& a, Vec& b) { return a + b; }, (s[k][0] + s[k][1]) + (s[k][2] + s[k][3]));
    }
  }
  for (; i < n; ++i) {
    const auto xi = static_cast<acc>(x[i * stride]);
    for (int k = 0; k < K; ++k) {
      out[k] += xi * ys[k][i];
    }
  }
}

// The online softmax of one text's block of heads, as a reducer for reduce_rows.
template <typename scalar_t>
struct SoftmaxReducer {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const acc* query;  // the block's heads, [heads, head_dim]
  acc scale;
  int64_t heads, head_dim;
  acc* weighted;     // [heads * head_dim]: sum over rows of exp(score - running_max) * row
  acc* running_max;  // [heads]
  acc* total;        // [heads]: sum over rows of exp(score - running_max)
  acc* scores;       // [heads, seq_len]: each row's raw score, kept when the weights are returned; else nullptr
  int64_t seq_len;

  void init(const scalar_t* row, int64_t stride, int64_t n, int64_t l) {
    std::fill_n(weighted, n, acc(0));
    std::fill_n(running_max, heads, -std::numeric_limits<acc>::infinity());
    std::fill_n(total, heads, acc(0));
    step(&row, &l, 1, stride, n);
  }

  void step(const scalar_t* const* rows, const int64_t* ls, int k, int64_t stride, int64_t /*n*/) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = h * head_dim;
      const acc* q = query + offset;
      const scalar_t* x[kRowGroup];
      acc s[kRowGroup];
      acc group_max = running_max[h];
      for (int r = 0; r < k; ++r) {
        x[r] = rows[r] + offset * stride;
        dots<1>(x[r], stride, &q, head_dim, &s[r]);
        s[r] *= scale;
        if (scores != nullptr) {
          scores[h * seq_len + ls[r]] = s[r];
        }
        group_max = std::max(group_max, s[r]);  // a NaN score is passed over here and poisons the total below
      }
      acc* w = weighted + offset;
      if (group_max > running_max[h]) {
        if (total[h] != acc(0)) {
          const acc factor = std::exp(running_max[h] - group_max);
          scale_in_place(w, factor);
          total[h] *= factor;
        }
        running_max[h] = group_max;
      }
      acc p[kRowGroup];
      for (int r = 0; r < k; ++r) {
        p[r] = std::exp(s[r] - running_max[h]);
        total[h] += p[r];
      }
      add_rows(w, p, x, k, stride);
    }
  }

  void scale_in_place(acc* w, acc factor) const {
    int64_t i = 0;
    for (; i + Vec::size() <= head_dim; i += Vec::size()) {
      (Vec::loadu(w + i) * Vec(factor)).store(w + i);
    }
    for (; i < head_dim; ++i) {
      w[i] *= factor;
    }
  }

  // w += sum_r p[r] * x[r], row by row for each element.
  void add_rows(acc* w, const acc* p, const scalar_t* const* x, int k, int64_t stride) const {
    int64_t i = 0;
    if (stride == 1) {
      for (; i + Vec::size() <= head_dim; i += Vec::size()) {
        Vec a = Vec::loadu(w + i);
        for (int r = 0; r < k; ++r) {
          a = at::vec::fmadd(Vec(p[r]), load_widened(x[r] + i), a);
        }
        a.store(w + i);
      }
    }
    for (; i < head_dim; ++i) {
      for (int r = 0; r < k; ++r) {
        w[i] += p[r] * static_cast<acc>(x[r][i * stride]);
      }
    }
  }
};

template <typename scalar_t>
void attention_forward_typed(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query,
                             double scale, at::Tensor& out, at::Tensor& lse, at::Tensor& weights) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* q = query.const_data_ptr<acc>();
  scalar_t* o = out.data_ptr<scalar_t>();
  acc* log_sum = lse.data_ptr<acc>();
  acc* w = weights.defined() ? weights.data_ptr<acc>() : nullptr;
  with_row_selectors(RowSelection{valid, at::Tensor()}, seq_len, [&](int64_t rows_per_text, const auto& rows_of) {
    for_each_text_block(batch, rows_per_text, dim, head_dim, [&](int64_t b, int64_t d0, int64_t n) {
      const int64_t h0 = d0 / head_dim, block_heads = n / head_dim;
      std::vector<acc> state(n + 2 * block_heads);
      acc* scores = w != nullptr ? w + (b * heads + h0) * seq_len : nullptr;
      SoftmaxReducer<scalar_t> reducer{q + d0, static_cast<acc>(scale), block_heads, head_dim, state.data(),
                                       state.data() + n, state.data() + n + block_heads, scores, seq_len};
      const auto rows = rows_of(b);
      const int64_t count = reduce_rows(h + b * sb + d0 * sd, sl, sd, n, rows, reducer);
      scalar_t* dst = o + b * dim + d0;
      acc* text_lse = log_sum + b * heads + h0;
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        const acc total = count > 0 ? reducer.total[hh] : acc(0);
        text_lse[hh] = count > 0 ? reducer.running_max[hh] + std::log(total)
                                 : -std::numeric_limits<acc>::infinity();
        for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
          dst[i] = count > 0 ? static_cast<scalar_t>(state[i] / total) : scalar_t(0);
        }
      }
      if (scores != nullptr && count > 0) {
        rows.each([&](int64_t l) {
          for (int64_t hh = 0; hh < block_heads; ++hh) {
            scores[hh * seq_len + l] = std::exp(scores[hh * seq_len + l] - text_lse[hh]);
          }
        });
      }
    });
  });
}

// pa += c_pa * x and pr += c_pr * x over n features.
template <typename scalar_t>
inline void add_scaled_twice(acc_t<scalar_t>* pa, acc_t<scalar_t>* pr, acc_t<scalar_t> c_pa, acc_t<scalar_t> c_pr,
                             const scalar_t* x, int64_t stride, int64_t n) {
  using Vec = Vectorized<acc_t<scalar_t>>;
  int64_t i = 0;
  if (stride == 1) {
    const Vec va(c_pa), vr(c_pr);
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec xv = load_widened(x + i);
      at::vec::fmadd(va, xv, Vec::loadu(pa + i)).store(pa + i);
      at::vec::fmadd(vr, xv, Vec::loadu(pr + i)).store(pr + i);
    }
  }
  for (; i < n; ++i) {
    const auto xi = static_cast<acc_t<scalar_t>>(x[i * stride]);
    pa[i] += c_pa * xi;
    pr[i] += c_pr * xi;
  }
}

// dst = p * g + c * q over n features.
template <typename acc>
inline void combine(acc* dst, acc p, const acc* g, acc c, const acc* q, int64_t n) {
  using Vec = Vectorized<acc>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(Vec(p), Vec::loadu(g + i), Vec(c) * Vec::loadu(q + i)).store(dst + i);
  }
  for (; i < n; ++i) {
    dst[i] = p * g[i] + c * q[i];
  }
}

template <typename scalar_t>
void attention_backward_typed(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                              const at::Tensor& valid, const at::Tensor& query, const at::Tensor& lse, double scale,
                              at::Tensor& grad_hidden, at::Tensor& grad_query) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* g = grad.const_data_ptr<acc>();
  const acc* gw = grad_weights.defined() ? grad_weights.const_data_ptr<acc>() : nullptr;
  const acc* q = query.const_data_ptr<acc>();
  const acc* log_sum = lse.const_data_ptr<acc>();
  scalar_t* gh = grad_hidden.data_ptr<scalar_t>();
  const auto sc = static_cast<acc>(scale);
  // Each text's share of the query gradient, summed over texts in order below: no atomics, same bits every run.
  std::vector<acc> query_parts(batch * dim);
  with_row_selectors(RowSelection{valid, at::Tensor()}, seq_len, [&](int64_t rows_per_text, const auto& rows_of) {
    for_each_text_block(batch, rows_per_text, dim, head_dim, [&](int64_t b, int64_t d0, int64_t n) {
      const int64_t h0 = d0 / head_dim, block_heads = n / head_dim;
      std::vector<int64_t> ls;
      rows_of(b).each([&](int64_t l) { ls.push_back(l); });
      const auto count = static_cast<int64_t>(ls.size());
      // prob[hh * count + j] = p of the j-th valid row; coef holds a, then scale * p * (a - delta).
      std::vector<acc> prob(block_heads * count), coef(block_heads * count), sums(2 * n, acc(0)),
          delta(block_heads, acc(0));
      acc* pa_rows = sums.data();     // sum_l p_l a_l x_l
      acc* p_rows = sums.data() + n;  // sum_l p_l x_l
      const scalar_t* text = h + b * sb + d0 * sd;
      const acc* gb = g + b * dim + d0;
      const acc* qb = q + d0;
      const acc* text_lse = log_sum + b * heads + h0;
      const acc* gwb = gw != nullptr ? gw + (b * heads + h0) * seq_len : nullptr;
      for (int64_t j = 0; j < count; ++j) {
        const scalar_t* row = text + ls[j] * sl;
        for (int64_t hh = 0; hh < block_heads; ++hh) {
          const int64_t offset = hh * head_dim;
          const scalar_t* x = row + offset * sd;
          const acc* ys[2] = {qb + offset, gb + offset};
          acc d[2];
          dots<2>(x, sd, ys, head_dim, d);
          const acc p = std::exp(d[0] * sc - text_lse[hh]);
          const acc a = d[1] + (gwb != nullptr ? gwb[hh * seq_len + ls[j]] : acc(0));
          prob[hh * count + j] = p;
          coef[hh * count + j] = a;
          delta[hh] += p * a;
          add_scaled_twice(pa_rows + offset, p_rows + offset, p * a, p, x, sd, head_dim);
        }
      }
      acc* part = query_parts.data() + b * dim + d0;
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
          part[i] = sc * (pa_rows[i] - delta[hh] * p_rows[i]);
        }
        for (int64_t j = hh * count; j < (hh + 1) * count; ++j) {
          coef[j] = sc * prob[j] * (coef[j] - delta[hh]);
        }
      }
      // Every row of the block once, in order: the valid rows from the sums above, zeros elsewhere.
      std::vector<acc> wide(std::is_same_v<scalar_t, acc> ? 0 : n);
      for (int64_t l = 0, j = 0; l < seq_len; ++l) {
        scalar_t* dst = gh + (b * seq_len + l) * dim + d0;
        if (j == count || ls[j] != l) {
          std::memset(static_cast<void*>(dst), 0, n * sizeof(scalar_t));
          continue;
        }
        acc* row = wide.empty() ? reinterpret_cast<acc*>(dst) : wide.data();
        for (int64_t hh = 0; hh < block_heads; ++hh) {
          const int64_t offset = hh * head_dim;
          combine(row + offset, prob[hh * count + j], gb + offset, coef[hh * count + j], qb + offset, head_dim);
        }
        if (!wide.empty()) {
          at::vec::convert(wide.data(), dst, n);
        }
        ++j;
      }
    });
  });
  acc* gq = grad_query.data_ptr<acc>();
  for (int64_t i = 0; i < dim; ++i) {
    acc total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      total += query_parts[b * dim + i];
    }
    gq[i] = total;
  }
}

}  // namespace

void attention_forward(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query, double scale,
                       at::Tensor& out, at::Tensor& lse, at::Tensor& weights) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool", [&] {
    attention_forward_typed<scalar_t>(hidden, valid, query, scale, out, lse, weights);
  });
}

void attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                        const at::Tensor& valid, const at::Tensor& query, const at::Tensor& lse, double scale,
                        at::Tensor& grad_hidden, at::Tensor& grad_query) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool_backward", [&] {
    attention_backward_typed<scalar_t>(grad, grad_weights, hidden, valid, query, lse, scale, grad_hidden,
                                       grad_query);
  });
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
