/*
 * The page-checksum loop of _pagesum.c compiled for AVX2 (XXH3's widest x86 path that
 * needs no AVX-512); _pagesum.c calls it only when the CPU has AVX2.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#include "xxhash.h"

void engram_page_sums_avx2(const uint8_t *src, size_t page, size_t pages, uint32_t *dst) {
    for (size_t i = 0; i < pages; i++) dst[i] = (uint32_t)XXH3_64bits(src + i * page, page);
}
#endif
