/* arena.h - a per-request bump allocator released in one call.
 *
 * A request's decoded messages, response strings and row copies live in one arena, so error
 * paths cannot leak. arena_protobuf_allocator() lets protobuf-c unpack into it.
 */
#ifndef CFLUE_ARENA_H
#define CFLUE_ARENA_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

struct arena_block;

struct arena {
    struct arena_block *head;
    ProtobufCAllocator pb;
};

/* arena_init prepares an empty arena. */
void arena_init(struct arena *a);

/* arena_cleanup frees everything allocated from the arena; it may then be reused. */
void arena_cleanup(struct arena *a);

/* arena_alloc returns n zeroed bytes that live until arena_cleanup; never NULL. */
void *arena_alloc(struct arena *a, size_t n);

/* arena_strdup copies s into the arena (NULL gives ""). */
char *arena_strdup(struct arena *a, const char *s);

/* arena_memdup copies n bytes into the arena, adding a NUL after them. */
void *arena_memdup(struct arena *a, const void *p, size_t n);

/* arena_protobuf_allocator returns a protobuf-c allocator that allocates from the arena and
 * ignores frees. */
ProtobufCAllocator *arena_protobuf_allocator(struct arena *a);

#endif
