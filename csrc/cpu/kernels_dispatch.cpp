#include <ATen/Version.h>

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

// ATen has already probed the CPU (and honours ATEN_CPU_CAPABILITY); follow its choice so that lmk_ops and
// torch never disagree about which instructions are safe.
Choice choose() {
  const std::string cap = at::get_cpu_capability();
#ifdef LMK_OPS_HAVE_AVX512
  if (cap == "AVX512") {
    return {&AVX512::kernels(), "AVX512"};
  }
#endif
#ifdef LMK_OPS_HAVE_AVX2
  if (cap == "AVX2" || cap == "AVX512") {
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
