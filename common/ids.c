/* ids.c - ULID-style ids. */
#include "ids.h"

#include "clock.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

static const char crockford[] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/* Each thread takes its ids' random bits from a pool of its own, refilled by one getrandom
 * call per 25 ids instead of one call per id (a system call costs more than the rest of an
 * id). A forked child empties the forking thread's pool (the only thread it has), so parent
 * and child never hand out the same bits. */
#define POOL_BYTES 250
static _Thread_local uint8_t pool[POOL_BYTES];
static _Thread_local size_t pool_left;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void empty_pool(void)
{
    memset(pool, 0, sizeof(pool));
    pool_left = 0;
}

static void empty_pool_in_children(void)
{
    (void)pthread_atfork(NULL, NULL, empty_pool);
}

/* random_bytes fills out with n (at most POOL_BYTES) random bytes, each used once. */
static void random_bytes(uint8_t *out, size_t n)
{
    pthread_once(&atfork_once, empty_pool_in_children);
    if (pool_left < n) {
        size_t got = 0;
        while (got < POOL_BYTES) {
            ssize_t r = getrandom(pool + got, POOL_BYTES - got, 0);
            if (r > 0) {
                got += (size_t)r;
            }
        }
        pool_left = POOL_BYTES;
    }
    uint8_t *take = pool + POOL_BYTES - pool_left;
    memcpy(out, take, n);
    memset(take, 0, n);
    pool_left -= n;
}

void ids_new(char out[IDS_MAX], const char *prefix)
{
    uint8_t bytes[16];
    uint64_t ms = (uint64_t)clock_now_ms();
    for (int i = 5; i >= 0; i--) {
        bytes[i] = (uint8_t)(ms & 0xff);
        ms >>= 8;
    }
    random_bytes(bytes + 6, 10);
    /* 128 bits -> 26 base32 characters, most significant first (2 leading pad bits). */
    char ulid[27];
    for (int i = 0; i < 26; i++) {
        int bit = i * 5 - 2; /* position of the character's first bit in the 128-bit value */
        unsigned v = 0;
        for (int k = 0; k < 5; k++) {
            int b = bit + k;
            v <<= 1;
            if (b >= 0) {
                v |= (bytes[b / 8] >> (7 - b % 8)) & 1u;
            }
        }
        ulid[i] = crockford[v];
    }
    ulid[26] = '\0';
    snprintf(out, IDS_MAX, "%.24s_%s", prefix, ulid);
}

/* name_chars returns the length of s when every character is A-Z a-z 0-9 . _ - (or one of
 * extra), else 0 (so for NULL and ""). */
static size_t name_chars(const char *s, const char *extra)
{
    size_t n = 0;
    for (const char *p = s; p && *p; p++, n++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-' || strchr(extra, c))) {
            return 0;
        }
    }
    return n;
}

bool ids_valid_name(const char *s, size_t max_len)
{
    size_t n = name_chars(s, "");
    return n >= 1 && n <= max_len && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

bool ids_valid_principal(const char *s)
{
    size_t n = name_chars(s, "@");
    return n >= 1 && n <= IDS_PRINCIPAL_MAX;
}

uint64_t ids_hash64_more(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

uint64_t ids_hash64(const char *s)
{
    return ids_hash64_more(IDS_HASH64_INIT, s ? s : "", s ? strlen(s) : 0);
}
