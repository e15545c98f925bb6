// The CPU kernel table: that of the best capability this CPU runs.
#include <cstdlib>
#include <string>

#include "cpu/kernel_types.h"

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

}  // namespace

const Kernels& kernels() {
  return *choice().kernels;
}

const std::string& kernels_capability() {
  return choice().name;
}

}  // namespace lmk_ops::cpu
