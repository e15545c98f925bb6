#include "cpu/rows.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/dispatch.h"
#include "common/error.h"
#include "common/host_path.h"
#include "cpu/row_bytes.h"

namespace lmk_ops::cpu {
namespace {

// How many times each (b, l) row is selected, as an int32 [B, L] count, for listed positions (a mask's rows are
// selected once each, and every row once when nothing selects).
std::vector<int32_t> times_listed(const RowSelection& rows, int64_t batch, int64_t seq_len) {
  std::vector<int32_t> times(batch * seq_len, 0);
  const int64_t listed = rows.positions.size(1);
  const int64_t* p = rows.positions.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * listed; ++i) {
    if (p[i] >= 0 && p[i] < seq_len) {  // trusted (checked by the forward), but never a write outside
      ++times[(i / listed) * seq_len + p[i]];
    }
  }
  return times;
}

// Rows of `dim` features a parallel task takes: about 32K values' work each (at least one row).
int64_t rows_per_task(int64_t dim) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, dim));
}

// Writes every row of grad_hidden once, split over (b, l) rows: a row selected once is a copy of its text's
// scaled gradient, an unselected row zeros (row_bytes.h), a row listed several times the scaled gradient times that
// count.
// offsets (a packed batch's [B + 1], or null): grad_hidden is [1, T, D] and row t is text b's where offsets[b] <= t
// < offsets[b + 1].
template <typename scalar_t, typename times_t>
void write_weighted_rows(const Tensor& scaled_wide, const times_t* times, const int64_t* offsets,
                         Tensor& grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int64_t seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const acc* src_wide = scaled_wide.const_data_ptr<acc>();
  const int64_t grain = rows_per_task(dim), texts = scaled_wide.size(0);
  // The gradient rows rounded to grad_hidden's dtype once, for the rows that copy them (split over the texts: on one
  // thread this was a third of the bfloat16 mean's backward for 4096 texts of 8 rows, D = 384).
  std::vector<scalar_t> narrow(std::is_same_v<scalar_t, acc> ? 0 : scaled_wide.numel());
  if (!narrow.empty()) {
    torch::stable::parallel_for(0, texts, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * dim; i < end * dim; ++i) {
        narrow[i] = static_cast<scalar_t>(src_wide[i]);
      }
    });
  }
  const scalar_t* src = narrow.empty() ? reinterpret_cast<const scalar_t*>(src_wide) : narrow.data();
  scalar_t* dst = grad_hidden.mutable_data_ptr<scalar_t>();
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(scalar_t);
  torch::stable::parallel_for(0, grad_hidden.size(0) * seq_len, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = offsets == nullptr ? row / seq_len
                                           : std::upper_bound(offsets, offsets + texts + 1, row) - offsets - 1;
      const int64_t n = times == nullptr ? 1 : static_cast<int64_t>(times[row]);
      scalar_t* out_row = dst + row * dim;
      if (n == 1) {
        copy_row_bytes(out_row, src + b * dim, row_bytes);
      } else if (n == 0) {
        zero_row_bytes(out_row, row_bytes);
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          out_row[d] = static_cast<scalar_t>(src_wide[b * dim + d] * static_cast<acc>(n));
        }
      }
    }
  });
}

// out[b, k] = hidden[b, positions[b, k]] (packed: hidden[starts[b] + positions[b, k]]), zeros where the position is
// -1. Split over (b, k) rows: each output row is written once (copied whole when hidden's features are contiguous).
template <typename scalar_t>
void gather_rows(const Tensor& hidden, const Tensor& positions, const Tensor& starts, Tensor& out) {
  const OffsetsView first(starts);
  const bool packed(first);  // hidden [T, D] (Kernels::gather_forward)
  const int64_t listed = positions.size(1), dim = hidden.size(packed ? 1 : 2);
  const int64_t sb = packed ? 0 : hidden.stride(0), sl = hidden.stride(packed ? 0 : 1);
  const int64_t sd = hidden.stride(packed ? 1 : 2);
  const scalar_t* h = hidden.const_data_ptr<scalar_t>();
  const int64_t* p = positions.const_data_ptr<int64_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t grain = rows_per_task(dim);
  torch::stable::parallel_for(0, out.size(0) * listed, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t l = p[row];
      scalar_t* dst = o + row * dim;
      if (l < 0) {
        zero_row_bytes(dst, dim * sizeof(scalar_t));
        continue;
      }
      const int64_t b = row / listed;
      const scalar_t* src = h + b * sb + (packed ? first[b] + l : l) * sl;
      if (sd == 1) {
        copy_row_bytes(dst, src, dim * sizeof(scalar_t));
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          dst[d] = src[d * sd];
        }
      }
    }
  });
}

// grad_hidden[b, l] = the sum of grad[b, k] over the k listing position l, on a zero-filled grad_hidden. Split
// over texts. A row listed once is a copy; a repeated position's gradients are summed in k order in the
// accumulation type and rounded once, so the result is deterministic and as exact as one rounding allows.
template <typename scalar_t>
void scatter_rows(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden) {
  using acc = acc_t<scalar_t>;
  const int64_t listed = positions.size(1), seq_len = grad_hidden.size(1), dim = grad_hidden.size(2);
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const int64_t* p = positions.const_data_ptr<int64_t>();
  scalar_t* out = grad_hidden.mutable_data_ptr<scalar_t>();
  torch::stable::parallel_for(0, grad_hidden.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> rows;  // (l, k), grouped by l with k increasing
    std::vector<acc> sum(dim);
    for (int64_t b = begin; b < end; ++b) {
      rows.clear();
      for (int64_t k = 0; k < listed; ++k) {
        if (p[b * listed + k] >= 0 && p[b * listed + k] < seq_len) {
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
          copy_row_bytes(dst, src, dim * sizeof(scalar_t));
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

// The rows of each run [starts[b], starts[b] + lengths[b]) where the mask [T] is true (a packed batch's valid rows
// or landmarks), each text's list after the one before: as many entries as rows selected. (A [B, the most rows a
// text selects] table took B times the longest text's rows: 4000 one-token texts beside one of 65536 tokens listed
// 262 million entries, 2 GB, twice over.)
RowListing list_masked_runs(const RowSelection& selection, int64_t batch, int64_t seq_len) {
  const int64_t* starts = selection.offsets.const_data_ptr<int64_t>();
  const int64_t* lengths = selection.lengths.const_data_ptr<int64_t>();
  const bool* mask = selection.mask.const_data_ptr<bool>();
  std::vector<int64_t> count(batch), start(batch);
  const int64_t mean_length = std::max<int64_t>(1, seq_len / std::max<int64_t>(1, batch));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / mean_length);
  torch::stable::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      count[b] = std::count(mask + starts[b], mask + starts[b] + lengths[b], true);
    }
  });
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    start[b] = total;
    total += count[b];
    longest = std::max(longest, count[b]);
  }
  std::vector<int64_t> order(total);
  torch::stable::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t* listed = order.data() + start[b];
      for (int64_t t = starts[b]; t < starts[b] + lengths[b]; ++t) {
        if (mask[t]) {
          *listed++ = t;
        }
      }
    }
  });
  RowList view{order.data(), count.data(), start.data(), longest, seq_len, /*listed=*/true};
  return {std::move(order), std::move(count), std::move(start), view};
}

// packed_offsets' checks of the offsets at(0), ..., at(batch): the first that fails, in OffsetCheck's order.
template <typename At>
void check_offsets(const OffsetChecks& checks, int64_t batch, const At& at) {
  if (at(0) != 0) {
    ::lmk_ops::fail(checks.message(OffsetCheck::kFirst), ", got ", at(0));
  }
  if (at(batch) != checks.tokens) {
    ::lmk_ops::fail(checks.message(OffsetCheck::kLast), ", got ", at(batch));
  }
  // A negative length anywhere is named before a text longer than max_seqlen (OffsetCheck's order).
  const auto first_text = [&](const auto& fails) {
    int64_t b = 0;
    while (b < batch && !fails(at(b + 1) - at(b))) {
      ++b;
    }
    return b;
  };
  int64_t b = first_text([](int64_t length) { return length < 0; });
  if (b < batch) {
    ::lmk_ops::fail(checks.message(OffsetCheck::kOrder), ", got ", at(b + 1) - at(b), " at [", b, "]");
  }
  b = first_text([&](int64_t length) { return length > checks.longest; });
  if (b < batch) {
    ::lmk_ops::fail(checks.message(OffsetCheck::kLongest), ", got ", at(b + 1) - at(b), " at [", b, "]");
  }
}

}  // namespace

RowListing list_rows(const RowSelection& selection, int64_t batch, int64_t seq_len) {
  const bool by_mask = selection.mask.defined();
  if (selection.offsets.defined() && !by_mask) {
    const int64_t* lengths = selection.lengths.const_data_ptr<int64_t>();
    const int64_t longest = batch > 0 ? *std::max_element(lengths, lengths + batch) : 0;
    const int64_t* starts = selection.offsets.const_data_ptr<int64_t>();
    return {{}, {}, {}, RowList{nullptr, lengths, starts, longest, seq_len, /*listed=*/false}};
  }
  if (selection.offsets.defined()) {
    return list_masked_runs(selection, batch, seq_len);
  }
  if (!by_mask && !selection.positions.defined()) {
    return {{}, {}, {}, RowList{nullptr, nullptr, nullptr, seq_len, seq_len, /*listed=*/false}};
  }
  const int64_t width = by_mask ? seq_len : selection.positions.size(1);
  std::vector<int64_t> order(batch * width), count(batch);
  int64_t* o = order.data();
  int64_t* c = count.data();
  const bool* mask = by_mask ? selection.mask.const_data_ptr<bool>() : nullptr;
  const int64_t* positions = by_mask ? nullptr : selection.positions.const_data_ptr<int64_t>();
  torch::stable::parallel_for(0, batch, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) {
                       int64_t n = 0;
                       for (int64_t i = 0; i < width; ++i) {
                         const int64_t value = by_mask ? (mask[b * width + i] ? i : -1) : positions[b * width + i];
                         if (value >= 0) {
                           o[b * width + n++] = value;
                         }
                       }
                       c[b] = n;
                     }
                   });
  return {std::move(order), std::move(count), {}, RowList{o, c, nullptr, width, seq_len, /*listed=*/true}};
}

void check_range(const Tensor& values, int64_t lo, int64_t hi, const Tensor& row_limits,
                 const std::string& expected, EntryName naming) {
  twin_checks_message_fits(expected);
  const int64_t* data = values.const_data_ptr<int64_t>();
  const int64_t* limits = row_limits.defined() ? row_limits.const_data_ptr<int64_t>() : nullptr;
  const int64_t numel = values.numel(), cols = values.size(-1);
  for (int64_t i = 0; i < numel; ++i) {
    if (data[i] < lo || data[i] > hi || (limits != nullptr && data[i] >= limits[i / cols])) {
      const int64_t r = i / cols, c = i % cols;
      if (naming == EntryName::kNone) {
        ::lmk_ops::fail(expected, ", got ", data[i]);
      }
      if (naming == EntryName::kLandmarks) {
        ::lmk_ops::fail(expected, ", got ", data[i], " in row ", r, " (landmarks[", r, ", ", c, "])");
      }
      if (naming == EntryName::kRow) {
        ::lmk_ops::fail(expected, ", got ", data[i], " in row ", i);
      }
      if (values.dim() == 1) {
        ::lmk_ops::fail(expected, ", got ", data[i], " at [", i, "]");
      }
      ::lmk_ops::fail(expected, ", got ", data[i], " at [", r, ", ", c, "]");
    }
  }
}

void grad_over_counts(const Tensor& grad, const Tensor& counts, const Tensor& mask, const Tensor& offsets,
                      const Tensor& positions, int64_t seq_len, Tensor& scaled) {
  const int64_t batch = grad.size(0), dim = grad.size(1);
  const int64_t* given = counts.defined() ? counts.const_data_ptr<int64_t>() : nullptr;
  const bool* m = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t* o = offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr;
  const int64_t* p = positions.defined() ? positions.const_data_ptr<int64_t>() : nullptr;
  const int64_t listed = p != nullptr ? positions.size(1) : 0;
  // Strides read once: each read is a call into libtorch (the stable ABI), too slow for the inner loop.
  const int64_t stride_b = grad.stride(0), stride_d = grad.stride(1);
  LMK_DISPATCH_FLOATING(grad.scalar_type(), "mean_pool_backward", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    // Split over the texts (B x D quotients: serial, they were a third of the mean's backward for 4096 texts of 8
    // rows, bfloat16, D = 384).
    const int64_t grain = rows_per_task(dim);
    const auto fill = [&](auto* out) {
      using out_t = std::remove_pointer_t<decltype(out)>;
      torch::stable::parallel_for(0, batch, grain, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
          int64_t count = seq_len;
          if (given != nullptr) {
            count = given[b];
          } else if (m != nullptr) {
            const int64_t begin = o != nullptr ? o[b] : b * seq_len, end = o != nullptr ? o[b + 1] : begin + seq_len;
            count = std::count(m + begin, m + end, true);
          } else if (p != nullptr) {
            count = std::count_if(p + b * listed, p + (b + 1) * listed, [](int64_t l) { return l >= 0; });
          }
          const auto divisor = static_cast<out_t>(std::max<int64_t>(count, 1));
          for (int64_t d = 0; d < dim; ++d) {
            out[b * dim + d] = static_cast<out_t>(g[b * stride_b + d * stride_d]) / divisor;
          }
        }
      });
    };
    if (scaled.scalar_type() == torch::headeronly::ScalarType::Double) {
      fill(scaled.mutable_data_ptr<double>());
    } else {
      fill(scaled.mutable_data_ptr<float>());
    }
  });
}

void mean_backward(const Tensor& scaled, const RowSelection& rows, Tensor& grad_hidden) {
  const int64_t* offsets = rows.offsets.defined() ? rows.offsets.const_data_ptr<int64_t>() : nullptr;
  LMK_DISPATCH_FLOATING(grad_hidden.scalar_type(), "mean_backward", [&] {
    if (rows.positions.defined()) {
      const std::vector<int32_t> times = times_listed(rows, grad_hidden.size(0), grad_hidden.size(1));
      write_weighted_rows<scalar_t>(scaled, times.data(), offsets, grad_hidden);
    } else if (rows.mask.defined()) {
      write_weighted_rows<scalar_t>(scaled, rows.mask.const_data_ptr<bool>(), offsets, grad_hidden);
    } else {
      write_weighted_rows<scalar_t, bool>(scaled, nullptr, offsets, grad_hidden);
    }
  });
}

void gather_forward(const Tensor& hidden, const Tensor& positions, const Tensor& starts, Tensor& out) {
  LMK_DISPATCH_FLOATING(hidden.scalar_type(), "landmark_gather",
                        [&] { gather_rows<scalar_t>(hidden, positions, starts, out); });
}

void gather_backward(const Tensor& grad, const Tensor& positions, Tensor& grad_hidden) {
  // Most rows are not landmarks, and zero-filling the whole gradient first is the cheapest way to write them.
  torch::stable::zero_(grad_hidden);
  LMK_DISPATCH_FLOATING(grad.scalar_type(), "landmark_gather_backward", [&] {
    scatter_rows<scalar_t>(grad, positions, grad_hidden);
  });
}

void find_rows(const Tensor& valid, const Tensor& offsets, int64_t batch, int64_t seq_len, bool last,
               Tensor& positions, Tensor& counts) {
  const bool* v = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;
  const OffsetsView s(offsets);
  const int64_t width = positions.size(1);
  int64_t* position_out = positions.mutable_data_ptr<int64_t>();
  int64_t* count_out = counts.defined() ? counts.mutable_data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = s ? s[b] : b * seq_len, length = s ? s[b + 1] - s[b] : seq_len;
    int64_t seen = 0;
    for (int64_t i = 0; i < length && (count_out != nullptr || seen < width); ++i) {
      const int64_t position = last ? length - 1 - i : i;
      if (v == nullptr || v[start + position]) {
        if (seen < width) {
          position_out[b * width + seen] = position;
        }
        ++seen;
      }
    }
    for (int64_t k = std::min(seen, width); k < width; ++k) {
      position_out[b * width + k] = -1;
    }
    if (count_out != nullptr) {
      count_out[b] = seen;
    }
  }
}

void shift_rows(const Tensor& values, const Tensor& starts, int64_t sign, Tensor& out) {
  const int64_t* s = starts.const_data_ptr<int64_t>();
  const int64_t batch = values.size(0), width = values.size(1);  // read once: a call into libtorch each
  LMK_DISPATCH_INDEX(values.scalar_type(), "shift_rows", [&] {
    const index_t* v = values.const_data_ptr<index_t>();
    index_t* o = out.mutable_data_ptr<index_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t shift = sign * s[b];
      for (int64_t i = b * width; i < (b + 1) * width; ++i) {
        o[i] = static_cast<index_t>(v[i] >= 0 ? v[i] + shift : -1);
      }
    }
  });
}

void packed_offsets(const Tensor& cu_seqlens, const OffsetChecks* checks, Tensor& offsets, Tensor& lengths) {
  const int64_t batch = cu_seqlens.size(0) - 1, stride = cu_seqlens.stride(0);  // read once: a libtorch call each
  int64_t* o = offsets.defined() ? offsets.mutable_data_ptr<int64_t>() : nullptr;
  int64_t* n = lengths.defined() ? lengths.mutable_data_ptr<int64_t>() : nullptr;
  LMK_DISPATCH_INDEX(cu_seqlens.scalar_type(), "packed_offsets", [&] {
    const index_t* c = cu_seqlens.const_data_ptr<index_t>();
    const auto at = [&](int64_t b) { return static_cast<int64_t>(c[b * stride]); };
    for (int64_t b = 0; o != nullptr && b <= batch; ++b) {
      o[b] = at(b);
    }
    for (int64_t b = 0; n != nullptr && b < batch; ++b) {
      n[b] = at(b + 1) - at(b);
    }
    if (checks != nullptr) {
      if constexpr (kCpuTwin) {  // each message is built only to be measured: a release build skips it
        for (int check = 0; check < kOffsetChecks; ++check) {
          twin_checks_message_fits(checks->message(static_cast<OffsetCheck>(check)));
        }
      }
      check_offsets(*checks, batch, at);
    }
  });
}

}  // namespace lmk_ops::cpu
