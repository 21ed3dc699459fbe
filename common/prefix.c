#include "common/prefix.h"

#include "common/budget.h"  /* TSR_KV_BLOCK */

static inline uint64_t rotl(uint64_t x, int b) { return x << b | x >> (64 - b); }

static inline uint64_t load_le(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#define SIPROUND                                                                          \
    do {                                                                                  \
        v0 += v1, v1 = rotl(v1, 13), v1 ^= v0, v0 = rotl(v0, 32);                         \
        v2 += v3, v3 = rotl(v3, 16), v3 ^= v2;                                            \
        v0 += v3, v3 = rotl(v3, 21), v3 ^= v0;                                            \
        v2 += v1, v1 = rotl(v1, 17), v1 ^= v2, v2 = rotl(v2, 32);                         \
    } while (0)

uint64_t tsr_siphash(const uint8_t key[TSR_PREFIX_SECRET], const void *msg, size_t len)
{
    const uint8_t *in = msg;
    uint64_t k0 = load_le(key, 8), k1 = load_le(key + 8, 8);
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    size_t whole = len & ~(size_t)7;
    for (size_t i = 0; i < whole; i += 8) {
        uint64_t m = load_le(in + i, 8);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t b = (uint64_t)len << 56 | load_le(in + whole, len - whole);
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

uint64_t tsr_prefix_key(const uint8_t secret[TSR_PREFIX_SECRET], uint64_t parent,
                        const int32_t *tokens)
{
    uint8_t msg[8 + 4 * TSR_KV_BLOCK];
    for (int i = 0; i < 8; i++) msg[i] = (uint8_t)(parent >> (8 * i));
    for (int t = 0; t < TSR_KV_BLOCK; t++)
        for (int i = 0; i < 4; i++) msg[8 + 4 * t + i] = (uint8_t)((uint32_t)tokens[t] >> (8 * i));
    uint64_t k = tsr_siphash(secret, msg, sizeof msg);
    return k ? k : 1;   /* 0 means "no key" to the pool */
}

int tsr_prefix_keys(const uint8_t secret[TSR_PREFIX_SECRET], const int32_t *tokens, int n,
                    uint64_t *out)
{
    int blocks = n > 0 ? n / TSR_KV_BLOCK : 0;
    uint64_t parent = 0;
    for (int k = 0; k < blocks; k++) parent = out[k] = tsr_prefix_key(secret, parent, tokens + (size_t)k * TSR_KV_BLOCK);
    return blocks;
}
