#pragma once
// Whole rows written by the row kernels (rows.cpp: a gradient row of zeros or a copied row, a gathered row) with
// 16-byte vector moves instead of memset/memcpy. For a row of 2 KiB or more (768 float32 features are 3 KiB) glibc
// takes `rep stosb` / `rep movsb`, which on a new gradient's fresh pages cost twice the user time of plain stores:
// a packed batch's landmark-mean gradient (126,476 x 768 float32, 2 threads) spent 39-48 ms of user time a call
// against 21-25 for torch.zeros of the same shape. Internal linkage (a static copy per file), so that a file
// compiled for a CPU capability never lends its copy to another.
#include <cstddef>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace lmk_ops::cpu {
namespace {

inline void zero_row_bytes(void* dst, size_t n) {
  auto* d = static_cast<char*>(dst);
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_setzero_si128());
  }
#endif
  std::memset(d + i, 0, n - i);
}

inline void copy_row_bytes(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
#endif
  std::memcpy(d + i, s + i, n - i);
}

}  // namespace
}  // namespace lmk_ops::cpu
