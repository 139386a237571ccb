/* mem.c - allocation with abort on out-of-memory. */
#include "mem.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void oom(size_t n)
{
    fprintf(stderr,
            "level=error event=out_of_memory bytes=%zu msg=\"allocation failed; "
            "exiting, recovery runs at next start\"\n",
            n);
    abort();
}

void *mem_alloc(size_t n)
{
    void *p = calloc(1, n ? n : 1);
    if (!p) {
        oom(n);
    }
    return p;
}

void *mem_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        oom(n);
    }
    return q;
}

char *mem_strdup(const char *s)
{
    return s ? mem_strndup(s, strlen(s)) : NULL;
}

char *mem_strndup(const char *s, size_t n)
{
    size_t len = strnlen(s, n);
    char *p = mem_alloc(len + 1);
    memcpy(p, s, len);
    return p;
}

char *mem_asprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return mem_strdup("");
    }
    char *p = mem_alloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(p, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return p;
}
