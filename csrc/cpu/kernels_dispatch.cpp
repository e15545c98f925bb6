// The CPU kernel table: that of the best capability this CPU runs.
#include <cpuid.h>

#include <cstdlib>
#include <cstring>
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

// Whether this is an AMD Zen 4 (family 19h, models 10h-1Fh, 60h-7Fh and A0h-AFh; family 19h's other models are
// Zen 3).
bool is_zen4() {
  __builtin_cpu_init();
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_is("amd") || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) {
    return false;
  }
  const unsigned int base_family = (eax >> 8) & 0xF;
  const unsigned int family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
  const unsigned int model = ((eax >> 4) & 0xF) | (((eax >> 16) & 0xF) << 4);
  return family == 0x19 && ((model >= 0x10 && model <= 0x1F) || (model >= 0x60 && model <= 0x7F) ||
                            (model >= 0xA0 && model <= 0xAF));
}

// LMK_OPS_PREFETCH=l1 or l2 where set, for every row (lmk_ops' import refuses other values); else L2 on Zen 4, L2
// for rows of 32- and 64-bit values and L1 for 16-bit ones on Intel CPUs, and L1 elsewhere.
// The kernels prefetch the rows they read next into L1, which measured faster on Zen 5 and no slower on an Intel
// Xeon of family 6 model 207 (pool_kernels.cpp, prefetch_rows; attention_kernels.cpp, prefetch_span). On an Intel
// Xeon of family 6 model 167 (2 cores, 2026-12-07) the float32 kernels were faster with the L2 set (prefetcht2, the
// mean and the maximum ten rows ahead), the bfloat16 mean and maximum slower: 2 threads, three rounds in alternating
// processes, each op timed in turns with hidden.sum(), ms, L1 -> L2: float32 1x32768x1024 mean 4.04-4.40 ->
// 3.28-4.13, max 4.37-4.76 -> 3.40-4.08, attention with one head 5.11-5.61 -> 4.23-4.75, 16 heads 6.24-6.78 ->
// 4.97-5.63; 8x4096x1024 alike; bfloat16 1x32768x1024 mean 1.46-1.48 -> 1.47-1.57, max 1.47-1.51 -> 1.53-1.63,
// attention level; 32x512x768 level either way. This split against L1 for every row, three more rounds: float32
// 1x32768x1024 mean 3.49-3.94 -> 2.90-3.50 ms, max 3.72-4.43 -> 2.93-3.47, one head 4.61-5.24 -> 3.67-4.37, 16
// heads 5.43-6.31 -> 4.29-4.92; float64 1x16384x1024 mean 2.99-3.36 -> 2.83-3.05, max 3.26-3.75 -> 2.91-3.15, 16
// heads 5.07-5.65 -> 4.62-4.95; the packed 120 texts x 768 float32 mean 14.8-15.5 -> 14.0-15.2, max 15.9-16.8 ->
// 14.2-15.5; 32x512x768 and the float32 mean's forward+backward level (docs/performance.md, that Xeon's section).
// A float32 row is twice a bfloat16 row's lines: three rows ahead into L1 keep twice the lines in flight.
// On a 2-core Zen 4 (EPYC, family 19h model 11h) L1 prefetches made the kernels far slower, with either L1 hint
// (prefetcht0 or prefetchnta; prefetcht1 measured as prefetcht2 does): 2 threads, one text of 32768 x 1024, 10th
// percentile of 100 calls in ms, this build with LMK_OPS_PREFETCH=l1 -> l2, two rounds in alternating processes:
// bfloat16 mean 2.74-2.98 -> 1.34-1.51, bfloat16 attention with 16 heads 4.26-4.46 -> 2.60-3.19, one head
// 3.23-3.44 -> 2.10, float32 with one head 7.05-7.57 -> 4.44-4.48, bfloat16 maximum 2.45-2.50 -> 1.98-2.00;
// float32 mean within the noise (4.48-4.84 -> 4.33-5.25); hidden.sum() 1.2-1.7 ms in bfloat16. Rows already in L2
// (the report's 32 short texts) do not change.
PrefetchLevels choose_prefetch_levels() {
  const char* variable = std::getenv("LMK_OPS_PREFETCH");
  if (variable != nullptr && std::strcmp(variable, "l1") == 0) {
    return {true, true};
  }
  if (variable != nullptr && std::strcmp(variable, "l2") == 0) {
    return {false, false};
  }
  if (is_zen4()) {  // which also initialises __builtin_cpu_is
    return {false, false};
  }
  return {true, !__builtin_cpu_is("intel")};
}

}  // namespace

extern const PrefetchLevels prefetch_levels = choose_prefetch_levels();

const char* prefetch_levels_name() {
  if (prefetch_levels.narrow_into_l1 == prefetch_levels.wide_into_l1) {
    return prefetch_levels.narrow_into_l1 ? "L1" : "L2";
  }
  return "L1 for 16-bit rows, L2 for wider";  // the one split choose_prefetch_levels makes (Intel)
}

const Kernels& kernels() {
  return *choice().kernels;
}

const std::string& kernels_capability() {
  return choice().name;
}

}  // namespace lmk_ops::cpu
