// The CPU kernel table: the best capability this CPU runs, behind an adapter from the op layer's ATen tensors.
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <cstdlib>
#include <string>

#include "cpu/kernel_types.h"
#include "ops/kernels.h"

namespace lmk_ops::cpu {

// One table per capability object compiled from pool_kernels.cpp (see CMakeLists.txt).
#define LMK_DECLARE_CAPABILITY(cap) \
  namespace cap {                   \
  const Kernels& kernels();     \
  }
LMK_DECLARE_CAPABILITY(DEFAULT)
#ifdef LMK_OPS_HAVE_AVX2
LMK_DECLARE_CAPABILITY(AVX2)
#endif
#ifdef LMK_OPS_HAVE_AVX512
LMK_DECLARE_CAPABILITY(AVX512)
#endif
#undef LMK_DECLARE_CAPABILITY

namespace {
struct Choice {
  const Kernels* kernels;
  std::string name;
};

#ifdef LMK_OPS_HAVE_AVX2
// Whether this CPU (and the OS, which must save the wider registers) runs each capability's copy: the instruction
// sets its compiler flags name (CMakeLists.txt).
bool runs_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
}
bool runs_avx512() {
  return runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

// The best capability this CPU runs, capped by ATEN_CPU_CAPABILITY (default, avx2 or avx512: the variable ATen's
// own kernels honour, so that lmk_ops and torch choose alike; other values are ignored, as ATen ignores them).
// Probed here rather than asked of ATen (at::get_cpu_capability), which the stable ABI does not offer.
Choice choose() {
  const char* variable = std::getenv("ATEN_CPU_CAPABILITY");
  std::string cap = variable != nullptr ? variable : "";
  if (cap != "default" && cap != "avx2" && cap != "avx512") {
    cap.clear();
  }
#ifdef LMK_OPS_HAVE_AVX512
  if ((cap.empty() || cap == "avx512") && runs_avx512()) {
    return {&AVX512::kernels(), "AVX512"};
  }
#endif
#ifdef LMK_OPS_HAVE_AVX2
  if (cap != "default" && runs_avx2()) {
    return {&AVX2::kernels(), "AVX2"};
  }
#endif
  return {&DEFAULT::kernels(), "DEFAULT"};
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

const Kernels& chosen() {
  return *choice().kernels;
}

// An ATen tensor as a stable-ABI one (the same tensor, one more reference). The CPU kernels are on the stable ABI
// and the op layer not yet (issue 14); this adapter, the one place the two meet, goes when the op layer moves too.
Tensor stable(const at::Tensor& t) {
  return Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}
RowSelection stable(const lmk_ops::RowSelection& r) {
  return {stable(r.mask), stable(r.positions), stable(r.starts), stable(r.lengths)};
}
AttentionRows stable(const lmk_ops::AttentionRows& r) {
  return {stable(r.listed), stable(r.valid), stable(r.text_of_row)};
}
}  // namespace

const lmk_ops::Kernels& kernels() {
  using lmk_ops::AttentionRows;  // the ATen forms, as the op layer passes them
  using lmk_ops::RowSelection;
  static const lmk_ops::Kernels adapter{
      [](const at::Tensor& values, int64_t lo, int64_t hi, const std::string& expected, bool landmarks) {
        chosen().check_range(stable(values), lo, hi, expected, landmarks);
      },
      [](const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out) {
        Tensor o = stable(out);
        chosen().mean_forward(stable(hidden), stable(rows), o);
      },
      [](const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out, at::Tensor& argmax) {
        Tensor o = stable(out), a = stable(argmax);
        chosen().max_forward(stable(hidden), stable(rows), o, a);
      },
      [](const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        chosen().mean_backward(stable(scaled), stable(rows), g);
      },
      [](const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        chosen().max_backward(stable(grad), stable(argmax), g);
      },
      [](const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out) {
        Tensor o = stable(out);
        chosen().gather_forward(stable(hidden), stable(positions), o);
      },
      [](const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        chosen().gather_backward(stable(grad), stable(positions), g);
      },
      [](const at::Tensor& hidden, const AttentionRows& rows, const at::Tensor& query, double scale, at::Tensor& out,
         at::Tensor& stats, at::Tensor& weights) {
        Tensor o = stable(out), s = stable(stats), w = stable(weights);
        chosen().attention_forward(stable(hidden), stable(rows), stable(query), scale, o, s, w);
      },
      [](const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden, const AttentionRows& rows,
         const at::Tensor& query, const at::Tensor& out, const at::Tensor& stats, double scale,
         at::Tensor& grad_hidden, at::Tensor& grad_query) {
        Tensor gh = stable(grad_hidden), gq = stable(grad_query);
        chosen().attention_backward(stable(grad), stable(grad_weights), stable(hidden), stable(rows), stable(query),
                                    stable(out), stable(stats), scale, gh, gq);
      },
  };
  return adapter;
}

const std::string& kernels_capability() {
  return choice().name;
}

}  // namespace lmk_ops::cpu
