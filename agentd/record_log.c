/* record_log.c - a conversation's records in memory, for one drive.
 *
 * A drive reads its conversation once when it starts (paging through Store.Read) and from
 * then on appends through the log: every record it appends joins the log when storaged
 * acknowledges it, at the offset storaged gave it. A drive holds its conversation's runnable
 * head under a fence, so no one else writes the records it reads (storaged's own
 * submission_settled records come only when a drive settles), and the log stays what the
 * stream holds without reading it again: the context of each turn, the answered() check
 * before settling and the repair of unresolved calls all run on it.
 *
 * A record may also be PENDING: written by the drive, carried by its next store write (an Append
 * or the Settle), and meanwhile at the end of the log with offset -1, so that the context, the
 * answered() check and lookups by id see it. That write's answer acknowledges it (offsets
 * assigned) or drops it. Pending records let one store call carry what several steps wrote:
 * the input with the system prompt, the final answer with the settlement.
 *
 * Records live in the messages they came in (a Read page, or an appended record's own copy);
 * an owner is freed when none of its records is left in the log. rlog_trim keeps the log
 * bounded by what the context and recovery still need.
 */
#include "record_log.h"

#include "mem.h"

#include <assert.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct rlog_owner {
    ProtobufCMessage *msg;
    size_t live; /* how many of its records are still in the log */
};

void rlog_init(struct record_log *log)
{
    memset(log, 0, sizeof(*log));
    log->last_offset = -1;
}

void rlog_cleanup(struct record_log *log)
{
    for (size_t i = 0; i < log->n_owners; i++) {
        if (log->owners[i].msg) {
            protobuf_c_message_free_unpacked(log->owners[i].msg, NULL);
        }
    }
    free(log->owners);
    free(log->recs);
    free(log->owner_of);
    rlog_init(log);
}

static int add_owner(struct record_log *log, ProtobufCMessage *msg)
{
    if (log->n_owners == log->cap_owners) {
        log->cap_owners = log->cap_owners ? log->cap_owners * 2 : 8;
        log->owners = mem_realloc(log->owners, sizeof(*log->owners) * log->cap_owners);
    }
    log->owners[log->n_owners].msg = msg;
    log->owners[log->n_owners].live = 0;
    return (int)log->n_owners++;
}

/* insert puts r into the log at its offset's place (almost always the end). */
static void insert(struct record_log *log, const Cflue__V1__Record *r, int owner)
{
    if (log->n == log->cap) {
        log->cap = log->cap ? log->cap * 2 : 64;
        log->recs = mem_realloc(log->recs, sizeof(*log->recs) * log->cap);
        log->owner_of = mem_realloc(log->owner_of, sizeof(*log->owner_of) * log->cap);
    }
    size_t at = log->n;
    while (at > 0 && log->recs[at - 1]->offset > r->offset) {
        at--;
    }
    memmove(&log->recs[at + 1], &log->recs[at], sizeof(*log->recs) * (log->n - at));
    memmove(&log->owner_of[at + 1], &log->owner_of[at], sizeof(*log->owner_of) * (log->n - at));
    log->recs[at] = r;
    log->owner_of[at] = owner;
    log->n++;
    log->owners[owner].live++;
    if (r->offset > log->last_offset) {
        log->last_offset = r->offset;
    }
    log->compactions += r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION;
}

static bool holds_offset(const struct record_log *log, int64_t offset)
{
    for (size_t i = log->n; i-- > 0 && log->recs[i]->offset >= offset;) {
        if (log->recs[i]->offset == offset) {
            return true;
        }
    }
    return false;
}

void rlog_add_page(struct record_log *log, Cflue__V1__ReadResponse *page)
{
    assert(!log->n_pending);
    int owner = add_owner(log, &page->base);
    for (size_t i = 0; i < page->n_records; i++) {
        if (!holds_offset(log, page->records[i]->offset)) {
            insert(log, page->records[i], owner);
        }
    }
    if (!log->owners[owner].live) {
        protobuf_c_message_free_unpacked(&page->base, NULL);
        log->owners[owner].msg = NULL;
    }
}

/* copy_of returns a deep copy of rec that the log will own; *len_out its encoded size. */
static Cflue__V1__Record *copy_of(const Cflue__V1__Record *rec, size_t *len_out)
{
    /* rec points into the caller's stack and buffers */
    size_t len = protobuf_c_message_get_packed_size(&rec->base);
    *len_out = len;
    uint8_t *bytes = mem_alloc(len + 1);
    protobuf_c_message_pack(&rec->base, bytes);
    Cflue__V1__Record *copy = cflue__v1__record__unpack(NULL, len, bytes);
    free(bytes);
    if (!copy) {
        /* only allocation can fail on bytes just packed: out of memory, as mem.c does */
        fputs("agentd: out of memory copying a record\n", stderr);
        abort();
    }
    return copy;
}

void rlog_add_pending(struct record_log *log, const Cflue__V1__Record *rec)
{
    if (rlog_find(log, rec->id)) {
        return;
    }
    size_t len;
    Cflue__V1__Record *copy = copy_of(rec, &len);
    copy->offset = -1;
    log->pending_bytes += len;
    int owner = add_owner(log, &copy->base);
    if (log->n == log->cap) {
        log->cap = log->cap ? log->cap * 2 : 64;
        log->recs = mem_realloc(log->recs, sizeof(*log->recs) * log->cap);
        log->owner_of = mem_realloc(log->owner_of, sizeof(*log->owner_of) * log->cap);
    }
    log->recs[log->n] = copy; /* at the end, whatever its offset: it has none yet */
    log->owner_of[log->n++] = owner;
    log->owners[owner].live++;
    log->n_pending++;
}

Cflue__V1__Record **rlog_pending(const struct record_log *log, size_t *n)
{
    *n = log->n_pending;
    /* the records are the log's own copies (never const in fact): a request may carry them */
    return log->n_pending ? (Cflue__V1__Record **)&log->recs[log->n - log->n_pending] : NULL;
}

void rlog_ack_pending(struct record_log *log, size_t n, int64_t first_offset)
{
    assert(n <= log->n_pending);
    for (size_t i = log->n - log->n_pending, end = i + n; i < end; i++) {
        Cflue__V1__Record *r = (Cflue__V1__Record *)log->recs[i];
        r->offset = first_offset++;
        if (r->offset > log->last_offset) {
            log->last_offset = r->offset;
        }
        log->compactions += r->body_case == CFLUE__V1__RECORD__BODY_COMPACTION;
        size_t len = protobuf_c_message_get_packed_size(&r->base);
        log->pending_bytes -= len < log->pending_bytes ? len : log->pending_bytes;
    }
    log->n_pending -= n;
    if (!log->n_pending) {
        log->pending_bytes = 0;
    }
}

void rlog_drop_pending(struct record_log *log)
{
    while (log->n_pending) {
        struct rlog_owner *o = &log->owners[log->owner_of[--log->n]];
        if (--o->live == 0) {
            protobuf_c_message_free_unpacked(o->msg, NULL);
            o->msg = NULL;
        }
        log->n_pending--;
    }
    log->pending_bytes = 0;
}

const Cflue__V1__Record *rlog_find(const struct record_log *log, const char *id)
{
    for (size_t i = log->n; i-- > 0;) {
        if (!strcmp(log->recs[i]->id, id)) {
            return log->recs[i];
        }
    }
    return NULL;
}

const Cflue__V1__Record *rlog_latest(const struct record_log *log, Cflue__V1__Record__BodyCase body)
{
    for (size_t i = log->n; i-- > 0;) {
        if (log->recs[i]->body_case == body) {
            return log->recs[i];
        }
    }
    return NULL;
}

void rlog_trim(struct record_log *log, const char *own)
{
    assert(!log->n_pending);
    const Cflue__V1__Record *comp = rlog_latest(log, CFLUE__V1__RECORD__BODY_COMPACTION);
    const Cflue__V1__Record *sys = rlog_latest(log, CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT);
    int64_t keep_from = comp ? comp->compaction->first_kept_offset : -1;
    for (size_t i = 0; i < log->n; i++) {
        if (!strcmp(log->recs[i]->submission_id, own)) {
            keep_from = log->recs[i]->offset < keep_from ? log->recs[i]->offset : keep_from;
            break;
        }
    }
    size_t kept = 0;
    for (size_t i = 0; i < log->n; i++) {
        const Cflue__V1__Record *r = log->recs[i];
        bool drop = r->body_case == CFLUE__V1__RECORD__BODY_ASSISTANT_DELTA ||
                    (r->offset < keep_from && r != comp && r != sys);
        if (!drop) {
            log->recs[kept] = r;
            log->owner_of[kept++] = log->owner_of[i];
            continue;
        }
        struct rlog_owner *o = &log->owners[log->owner_of[i]];
        if (--o->live == 0) {
            protobuf_c_message_free_unpacked(o->msg, NULL);
            o->msg = NULL;
        }
    }
    log->n = kept;
}
