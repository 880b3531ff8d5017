/*
 * The page checksum of format version 3, one definition for every C helper that computes
 * it (table/_pagesum.c, tiers/_uring.c): the low 32 bits of XXH3-64 (seed 0) of each page,
 * through _pagesum_avx2.c (compiled into the same extension) when the CPU has AVX2, else
 * the portable XXH3 loop; both give the same values.
 *
 * Include after xxhash.h (with XXH_INLINE_ALL) and call pagesum_init() once when the
 * module is initialised.
 */
#ifndef ENGRAM_PAGESUM_DISPATCH_H
#define ENGRAM_PAGESUM_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
void engram_page_sums_avx2(const uint8_t *src, size_t page, size_t pages, uint32_t *dst);
static int pagesum_cpu_has_avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
static void engram_page_sums_avx2(const uint8_t *src, size_t page, size_t pages, uint32_t *dst) {}
static int pagesum_cpu_has_avx2(void) { return 0; }
#endif

static int pagesum_avx2;

static void pagesum_init(void) { pagesum_avx2 = pagesum_cpu_has_avx2(); }

/* dst[i] = the checksum of page i of src (pages of `page` bytes); `portable` skips AVX2. */
static void pagesum_pages(const uint8_t *src, size_t page, size_t pages, uint32_t *dst, int portable)
{
    if (pagesum_avx2 && !portable) {
        engram_page_sums_avx2(src, page, pages, dst);
        return;
    }
    for (size_t i = 0; i < pages; i++) dst[i] = (uint32_t)XXH3_64bits(src + i * page, page);
}

#endif
