/* mem.h - allocation that aborts the process with a clear message when memory runs out.
 *
 * The daemons are crash-only: recovery is their start-up path, so out-of-memory ends the
 * process instead of threading an error through every caller.
 */
#ifndef CFLUE_MEM_H
#define CFLUE_MEM_H

#include <stddef.h>

/* mem_alloc returns n zeroed bytes; never NULL. */
void *mem_alloc(size_t n);

/* mem_realloc resizes p to n bytes; never NULL. */
void *mem_realloc(void *p, size_t n);

/* mem_strdup copies s (NULL gives NULL). */
char *mem_strdup(const char *s);

/* mem_strndup copies at most n bytes of s and terminates the copy. */
char *mem_strndup(const char *s, size_t n);

/* mem_asprintf returns a newly allocated printf-formatted string; never NULL. The caller frees
 * it with free(). */
char *mem_asprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
