/* arena.c - bump allocation in chained blocks. */
#include "arena.h"

#include "mem.h"

#include <stdlib.h>
#include <string.h>

#define BLOCK_SIZE 8192

struct arena_block {
    struct arena_block *next;
    size_t used, size;
    max_align_t data[];
};

static void *pb_alloc(void *data, size_t n)
{
    return arena_alloc(data, n);
}

static void pb_free(void *data, void *p)
{
    (void)data;
    (void)p;
}

void arena_init(struct arena *a)
{
    a->head = NULL;
    a->pb.alloc = pb_alloc;
    a->pb.free = pb_free;
    a->pb.allocator_data = a;
}

void arena_cleanup(struct arena *a)
{
    while (a->head) {
        struct arena_block *b = a->head;
        a->head = b->next;
        free(b);
    }
}

void *arena_alloc(struct arena *a, size_t n)
{
    n = (n + _Alignof(max_align_t) - 1) & ~(_Alignof(max_align_t) - 1);
    if (n == 0) {
        n = _Alignof(max_align_t);
    }
    struct arena_block *b = a->head;
    if (!b || b->size - b->used < n) {
        size_t size = n > BLOCK_SIZE / 2 ? n : BLOCK_SIZE;
        b = mem_alloc(sizeof(*b) + size);
        b->size = size;
        if (n > BLOCK_SIZE / 2 && a->head) {
            /* keep the partly used current block in front for small allocations */
            b->next = a->head->next;
            a->head->next = b;
            b->used = n;
            return (char *)b->data;
        }
        b->next = a->head;
        a->head = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

void *arena_memdup(struct arena *a, const void *p, size_t n)
{
    char *q = arena_alloc(a, n + 1);
    if (n) {
        memcpy(q, p, n);
    }
    return q;
}

char *arena_strdup(struct arena *a, const char *s)
{
    return s ? arena_memdup(a, s, strlen(s)) : arena_memdup(a, "", 0);
}

ProtobufCAllocator *arena_protobuf_allocator(struct arena *a)
{
    return &a->pb;
}
