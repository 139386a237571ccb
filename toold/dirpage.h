/* dirpage.h - one page of a directory's entries in name order, in memory bounded by the page.
 *
 * Sandbox.ReadDir pages through a directory sorted by name (bytewise). A directory may hold a
 * million entries and change between pages, so a page is not a slice of a sorted listing:
 * each page is one readdir pass from the directory's start that keeps, in a max-heap, the
 * `limit` + 1 smallest names greater than the previous page's last name (the page token's
 * position). Memory is O(limit) whatever the directory's size, and since pages are cut at
 * names, not at counts or readdir positions, an entry that exists throughout is listed exactly
 * once however entries are added or removed meanwhile.
 */
#ifndef CFLUE_TOOLD_DIRPAGE_H
#define CFLUE_TOOLD_DIRPAGE_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>

struct dirpage {
    char **names; /* n names sorted ascending (strcmp), each heap-allocated */
    size_t n;
    bool more; /* names after names[n - 1] exist */
};

/* dirpage_select reads the directory open at dirfd (the descriptor stays the caller's and is
 * not moved) and fills out with its `limit` (>= 1) smallest names that sort after `after`
 * ("" for the first page), "." and ".." left out. gone(gone_arg), when given, is asked every
 * few thousand entries and stops the pass with CF_CANCELLED when true. CF_IO when the
 * directory cannot be read. On success the caller frees out with dirpage_cleanup; on failure
 * out holds nothing. */
CF_MUST_CHECK enum cf_status dirpage_select(int dirfd, const char *after, size_t limit,
                                            bool (*gone)(void *), void *gone_arg,
                                            struct dirpage *out, struct cf_error *err);

/* dirpage_cleanup frees the names of a page (a zeroed page is fine). */
void dirpage_cleanup(struct dirpage *p);

#endif
