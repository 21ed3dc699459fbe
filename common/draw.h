/* draw.h: the random number behind a sampled token.
 *
 * The draw for the token at position p of a request is a pure function of
 * (seed, p): a request gives the same tokens whatever it was batched with,
 * and a request resumed elsewhere from its prompt plus the tokens already
 * streamed continues exactly.  Header-only and free of library calls so
 * the CUDA engine's kernels can use the very same function. */
#ifndef TSR_DRAW_H
#define TSR_DRAW_H

#include <stdint.h>

#if defined(__CUDACC__)
#define TSR_HD __host__ __device__
#else
#define TSR_HD
#endif

/* splitmix64's finaliser: a bijection that mixes every input bit. */
static inline TSR_HD uint64_t tsr_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 53 random bits. */
static inline TSR_HD double tsr_draw(uint64_t seed, uint64_t position)
{
    uint64_t z = tsr_mix64(seed + 0x9e3779b97f4a7c15ull * (position + 1));
    return (double)(tsr_mix64(z ^ 0x5851f42d4c957f2dull) >> 11) * (1.0 / 9007199254740992.0);
}

#endif
