/* record_log.h - a conversation's records in memory, for one drive. */
#ifndef CFLUE_AGENTD_RECORD_LOG_H
#define CFLUE_AGENTD_RECORD_LOG_H

#include "cflue/v1/common.pb-c.h"
#include "cflue/v1/store.pb-c.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct rlog_owner;

/* The records a drive knows, in offset order. `recs` is read-only for callers: only the
 * rlog_ functions change it. */
struct record_log {
    const Cflue__V1__Record **recs;
    size_t n, cap;
    int *owner_of; /* recs[i] lives in owners[owner_of[i]] */
    struct rlog_owner *owners;
    size_t n_owners, cap_owners;
    int64_t last_offset;  /* the newest offset read or appended (-1: none) */
    int compactions;      /* compaction records seen, dropped ones included */
    size_t n_pending;     /* the last n_pending of recs are pending: not yet stored */
    size_t pending_bytes; /* their encoded size */
};

/* rlog_init makes an empty log. rlog_cleanup frees it and every record it holds; both are
 * idempotent on a zeroed or cleaned-up log. */
void rlog_init(struct record_log *log);
void rlog_cleanup(struct record_log *log);

/* rlog_add_page takes a Read page: its records join the log (those at an offset the log holds
 * already are skipped) and the log owns `page` afterwards (freed when none of its records is
 * left). */
void rlog_add_page(struct record_log *log, Cflue__V1__ReadResponse *page);

/* rlog_add_pending adds a copy of `rec` (the caller keeps rec) at the end of the log as
 * PENDING: written by the drive but not yet stored (offset -1). Every lookup sees it; the
 * drive's next store write carries it (rlog_pending), then rlog_ack_pending or
 * rlog_drop_pending settles it. A record whose id the log holds already is not added. */
void rlog_add_pending(struct record_log *log, const Cflue__V1__Record *rec);

/* rlog_pending returns the pending records in order (*n of them; NULL when none). */
Cflue__V1__Record **rlog_pending(const struct record_log *log, size_t *n);

/* rlog_ack_pending: storaged stored the first n pending records (n <= n_pending; those an
 * Append carried while more were added) at first_offset, first_offset + 1, ...; they are
 * ordinary records from now on, and the rest stay pending. */
void rlog_ack_pending(struct record_log *log, size_t n, int64_t first_offset);

/* rlog_drop_pending removes the pending records (their write failed: they are not in the
 * stream). */
void rlog_drop_pending(struct record_log *log);

/* rlog_find returns the record with id `id`, or NULL. The record stays the log's. */
const Cflue__V1__Record *rlog_find(const struct record_log *log, const char *id);

/* rlog_latest returns the newest record whose body is `body_case`, or NULL. */
const Cflue__V1__Record *rlog_latest(const struct record_log *log,
                                     Cflue__V1__Record__BodyCase body);

/* rlog_trim drops what no context and no recovery step of submission `own` needs any more:
 * assistant_delta records, and the records before both the newest compaction's first kept
 * offset and own's first record (recovery reads only own's part of the stream), except the
 * newest compaction and system prompt. Idempotent. */
void rlog_trim(struct record_log *log, const char *own);

#endif
