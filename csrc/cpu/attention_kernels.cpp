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
// can overflow: every exponent is <= 0. Only the softmax statistics are kept for the backward: per text and head
// the maximum score and the sum of exp(score - max), the two parts of the log-sum-exp max + log(sum).
//
// Backward, per text and head: with p_l = exp(s_l - max) / sum and a_l = <g, x_l> (+ the gradient of the returned
// weight), the score gradient is p_l (a_l - delta) with delta = sum_l p_l a_l. Written that way it cancels badly
// in float32 when the states share a large common part, so the backward works relative to the forward's output m
// (the weighted mean of the rows, so delta = <g, m> + sum_l p_l gw_l): with e_l = <g, x_l - m> + gw_l and
// S = sum_l p_l e_l, the score gradient is p_l (e_l - S), and the query gradient scale * sum_l p_l (e_l - S) x_l
// equals scale * (sum_l p_l e_l (x_l - m) - S sum_l p_l (x_l - m)), every term small where the rows agree. One
// pass reads each valid row once and keeps p_l, e_l and those two sums. The rows of grad_hidden,
// p_l g + scale p_l (e_l - S) q, need no hidden state: a second loop writes every one of them (zeros for the
// padding) without reading hidden again.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "cpu/attention_kernels.h"
#include "cpu/kernel_common.h"

namespace lmk_ops::cpu::CPU_CAPABILITY {
namespace {

// <x, y> over n features, or with kCentred <x - m, y> (feature i of x at x[i * stride]; m and y contiguous). Four
// independent accumulator chains hide the FMA latency. The forward and the backward both compute scores with this
// one function, so a score recomputed in the backward has the bits it had in the forward.
template <bool kCentred, typename scalar_t>
inline acc_t<scalar_t> dot(const scalar_t* x, int64_t stride, const acc_t<scalar_t>* m, const acc_t<scalar_t>* y,
                           int64_t n) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  constexpr int64_t W = Vec::size();
  const auto load = [&](int64_t i) {
    if constexpr (kCentred) {
      return load_widened(x + i) - Vec::loadu(m + i);
    } else {
      return load_widened(x + i);
    }
  };
  int64_t i = 0;
  acc total = 0;
  if (stride == 1) {
    Vec s[4] = {Vec(acc(0)), Vec(acc(0)), Vec(acc(0)), Vec(acc(0))};
    for (; i + 4 * W <= n; i += 4 * W) {
      for (int u = 0; u < 4; ++u) {
        s[u] = at::vec::fmadd(load(i + u * W), Vec::loadu(y + i + u * W), s[u]);
      }
    }
    for (; i + W <= n; i += W) {
      s[0] = at::vec::fmadd(load(i), Vec::loadu(y + i), s[0]);
    }
    total = at::vec::vec_reduce_all<acc>([](Vec& a, Vec& b) { return a + b; }, (s[0] + s[1]) + (s[2] + s[3]));
  }
  for (; i < n; ++i) {
    const auto xi = static_cast<acc>(x[i * stride]);
    total += (kCentred ? xi - m[i] : xi) * y[i];
  }
  return total;
}

// total[i] += chunk[i], then chunk[i] = 0, for n values: a chunk's sums folded into the running totals.
template <typename total_t, typename acc>
inline void fold_chunk(total_t* total, acc* chunk, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    total[i] += chunk[i];
    chunk[i] = acc(0);
  }
}

// Sums over rows run in chunks of kFoldRows rows in the accumulation type, each chunk's sum folded into a float64
// total: the float32 error then stays that of kFoldRows additions, whatever L.
constexpr int64_t kFoldRows = 32;

// The online softmax of one text's block of heads, as a reducer for reduce_rows. Call fold() after the last row.
template <typename scalar_t>
struct SoftmaxReducer {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const acc* query;  // the block's heads, [heads, head_dim]
  acc scale;
  int64_t heads, head_dim;
  acc* weighted;            // [n]: the current chunk's sum over rows of exp(score - running_max) * row
  double* weighted_total;   // [n]: the same over the folded chunks
  acc* running_max;         // [heads]
  acc* total;               // [heads]: the current chunk's sum over rows of exp(score - running_max)
  double* total_sum;        // [heads]: the same over the folded chunks
  acc* scores;              // [heads, seq_len]: each row's raw score, kept when the weights are returned; else nullptr
  int64_t seq_len;
  int64_t chunk_rows = 0;

  void init(const scalar_t* row, int64_t stride, int64_t n, int64_t l) {
    std::fill_n(weighted, n, acc(0));
    std::fill_n(weighted_total, n, 0.0);
    std::fill_n(running_max, heads, -std::numeric_limits<acc>::infinity());
    std::fill_n(total, heads, acc(0));
    std::fill_n(total_sum, heads, 0.0);
    step(&row, &l, 1, stride, n);
  }

  void fold() {
    fold_chunk(weighted_total, weighted, heads * head_dim);
    fold_chunk(total_sum, total, heads);
    chunk_rows = 0;
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
        s[r] = dot<false>(x[r], stride, nullptr, q, head_dim) * scale;
        if (scores != nullptr) {
          scores[h * seq_len + ls[r]] = s[r];
        }
        group_max = std::max(group_max, s[r]);  // a NaN score is passed over here and poisons the total below
      }
      acc* chunk_w = weighted + offset;
      if (group_max > running_max[h]) {
        if (running_max[h] != -std::numeric_limits<acc>::infinity()) {  // else nothing was added yet
          const acc factor = std::exp(running_max[h] - group_max);
          scale_in_place(weighted_total + offset, factor);
          scale_in_place(chunk_w, factor);
          total_sum[h] *= factor;
          total[h] *= factor;
        }
        running_max[h] = group_max;
      }
      acc p[kRowGroup];
      for (int r = 0; r < k; ++r) {
        p[r] = std::exp(s[r] - running_max[h]);
        total[h] += p[r];
      }
      add_rows(chunk_w, p, x, k, stride);
    }
    chunk_rows += k;
    if (chunk_rows >= kFoldRows) {
      fold();
    }
  }

  template <typename T>
  void scale_in_place(T* w, acc factor) const {
    int64_t i = 0;
    if constexpr (std::is_same_v<T, acc>) {
      for (; i + Vec::size() <= head_dim; i += Vec::size()) {
        (Vec::loadu(w + i) * Vec(factor)).store(w + i);
      }
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

// A score's probability from its text and head's statistics {max, sum}: exp(score - max) / sum, as a softmax
// computes it. Kept as that pair rather than one log-sum-exp number max + log(sum), the statistics lose nothing at
// any score magnitude: rounded to one number, the log-sum-exp carries an error of |max| ulps into every recomputed
// probability (and loses log(sum) entirely once |max| is large).
template <typename acc>
inline acc probability(acc score, const double* stats) {
  return std::exp(score - static_cast<acc>(stats[0])) / static_cast<acc>(stats[1]);
}

template <typename scalar_t>
void attention_forward_typed(const at::Tensor& hidden, const at::Tensor& valid, const at::Tensor& query,
                             double scale, at::Tensor& out, at::Tensor& stats, at::Tensor& weights) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* q = query.const_data_ptr<acc>();
  scalar_t* o = out.data_ptr<scalar_t>();
  double* all_stats = stats.data_ptr<double>();
  acc* w = weights.defined() ? weights.data_ptr<acc>() : nullptr;
  with_row_selectors(RowSelection{valid, at::Tensor()}, seq_len, [&](int64_t rows_per_text, const auto& rows_of) {
    for_each_text_block(batch, rows_per_text, dim, head_dim, [&](int64_t b, int64_t d0, int64_t n) {
      const int64_t h0 = d0 / head_dim, block_heads = n / head_dim;
      std::vector<acc> state(n + 2 * block_heads);
      std::vector<double> totals(n + block_heads);
      acc* scores = w != nullptr ? w + (b * heads + h0) * seq_len : nullptr;
      SoftmaxReducer<scalar_t> reducer{q + d0,          static_cast<acc>(scale), block_heads,
                                       head_dim,        state.data(),            totals.data(),
                                       state.data() + n, state.data() + n + block_heads, totals.data() + n,
                                       scores,          seq_len};
      const auto rows = rows_of(b);
      const int64_t count = reduce_rows(h + b * sb + d0 * sd, sl, sd, n, rows, reducer);
      reducer.fold();
      scalar_t* dst = o + b * dim + d0;
      double* text_stats = all_stats + (b * heads + h0) * 2;
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        const double total = count > 0 ? reducer.total_sum[hh] : 0.0;
        if (count > 0) {
          text_stats[2 * hh] = reducer.running_max[hh];
          text_stats[2 * hh + 1] = total;
        }
        for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
          dst[i] = count > 0 ? static_cast<scalar_t>(totals[i] / total) : scalar_t(0);
        }
      }
      if (scores != nullptr && count > 0) {
        rows.each([&](int64_t l) {
          for (int64_t hh = 0; hh < block_heads; ++hh) {
            scores[hh * seq_len + l] = probability(scores[hh * seq_len + l], text_stats + 2 * hh);
          }
        });
      }
    });
  });
}

// pe += c_pe * (x - m) and pr += c_pr * (x - m) over n features.
template <typename scalar_t>
inline void add_centred_twice(acc_t<scalar_t>* pe, acc_t<scalar_t>* pr, acc_t<scalar_t> c_pe, acc_t<scalar_t> c_pr,
                              const scalar_t* x, int64_t stride, const acc_t<scalar_t>* m, int64_t n) {
  using Vec = Vectorized<acc_t<scalar_t>>;
  int64_t i = 0;
  if (stride == 1) {
    const Vec ve(c_pe), vr(c_pr);
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec y = load_widened(x + i) - Vec::loadu(m + i);
      at::vec::fmadd(ve, y, Vec::loadu(pe + i)).store(pe + i);
      at::vec::fmadd(vr, y, Vec::loadu(pr + i)).store(pr + i);
    }
  }
  for (; i < n; ++i) {
    const auto y = static_cast<acc_t<scalar_t>>(x[i * stride]) - m[i];
    pe[i] += c_pe * y;
    pr[i] += c_pr * y;
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
                              const at::Tensor& valid, const at::Tensor& query, const at::Tensor& out,
                              const at::Tensor& stats, double scale, at::Tensor& grad_hidden,
                              at::Tensor& grad_query) {
  using acc = acc_t<scalar_t>;
  const int64_t batch = hidden.size(0), seq_len = hidden.size(1), dim = hidden.size(2);
  const int64_t sb = hidden.stride(0), sl = hidden.stride(1), sd = hidden.stride(2);
  const int64_t heads = query.size(0), head_dim = query.size(1);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const acc* g = grad.const_data_ptr<acc>();
  const acc* gw = grad_weights.defined() ? grad_weights.const_data_ptr<acc>() : nullptr;
  const acc* q = query.const_data_ptr<acc>();
  const acc* mean = out.const_data_ptr<acc>();
  const double* all_stats = stats.const_data_ptr<double>();
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
      // prob[hh * count + j] = p of the j-th valid row; coef holds e, then scale * p * (e - S).
      std::vector<acc> prob(block_heads * count), coef(block_heads * count);
      // Running sums, per feature: sum_l p_l e_l (x_l - m) and sum_l p_l (x_l - m); per head: S = sum_l p_l e_l.
      // Rows add into the current chunk's sums, folded into float64 totals every kFoldRows rows.
      std::vector<double> totals(2 * n + block_heads, 0.0);
      std::vector<acc> chunk_sums(2 * n + block_heads, acc(0));
      const double* pe_rows = totals.data();
      const double* p_rows = pe_rows + n;
      const double* total_pe = p_rows + n;
      acc* chunk = chunk_sums.data();  // the same three, for the current chunk
      const scalar_t* text = h + b * sb + d0 * sd;
      const acc* gb = g + b * dim + d0;
      const acc* qb = q + d0;
      const acc* mb = mean + b * dim + d0;
      const double* text_stats = all_stats + (b * heads + h0) * 2;
      const acc* gwb = gw != nullptr ? gw + (b * heads + h0) * seq_len : nullptr;
      for (int64_t j = 0; j < count; ++j) {
        const scalar_t* row = text + ls[j] * sl;
        for (int64_t hh = 0; hh < block_heads; ++hh) {
          const int64_t offset = hh * head_dim;
          const scalar_t* x = row + offset * sd;
          const acc p = probability(dot<false>(x, sd, nullptr, qb + offset, head_dim) * sc, text_stats + 2 * hh);
          const acc e = dot<true>(x, sd, mb + offset, gb + offset, head_dim) +
                        (gwb != nullptr ? gwb[hh * seq_len + ls[j]] : acc(0));
          prob[hh * count + j] = p;
          coef[hh * count + j] = e;
          chunk[2 * n + hh] += p * e;
          add_centred_twice(chunk + offset, chunk + n + offset, p * e, p, x, sd, mb + offset, head_dim);
        }
        if ((j + 1) % kFoldRows == 0 || j + 1 == count) {
          fold_chunk(totals.data(), chunk, 2 * n + block_heads);
        }
      }
      acc* part = query_parts.data() + b * dim + d0;
      for (int64_t hh = 0; hh < block_heads; ++hh) {
        for (int64_t i = hh * head_dim; i < (hh + 1) * head_dim; ++i) {
          part[i] = static_cast<acc>(sc * (pe_rows[i] - total_pe[hh] * p_rows[i]));
        }
        const auto text_sum = static_cast<acc>(total_pe[hh]);
        for (int64_t j = hh * count; j < (hh + 1) * count; ++j) {
          coef[j] = sc * prob[j] * (coef[j] - text_sum);
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
                       at::Tensor& out, at::Tensor& stats, at::Tensor& weights) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool", [&] {
    attention_forward_typed<scalar_t>(hidden, valid, query, scale, out, stats, weights);
  });
}

void attention_backward(const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden,
                        const at::Tensor& valid, const at::Tensor& query, const at::Tensor& out,
                        const at::Tensor& stats, double scale, at::Tensor& grad_hidden, at::Tensor& grad_query) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "attention_pool_backward", [&] {
    attention_backward_typed<scalar_t>(grad, grad_weights, hidden, valid, query, out, stats, scale, grad_hidden,
                                       grad_query);
  });
}

}  // namespace lmk_ops::cpu::CPU_CAPABILITY
