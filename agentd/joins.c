/* joins.c - messages queued behind a running submission join it.
 *
 * Between turns the host claims what is queued behind it (Store.ClaimJoinable: the deliveries
 * become JOINING into it), only when storaged's last answer counted something queued or a Submit
 * through this agentd admitted something behind it (a message admitted after that is claimed
 * as the conversation's next submission instead: FIFO holds either way), appends the
 * deliveries' inputs (input:<delivery>) in one Append and finalizes each
 * join (Store.FinalizeJoin: JOINED; they settle with the host). A delivery whose join is not
 * finalized goes back to the queue when the host settles and finds its input already in the
 * stream. The deliveries' submissions are kept for the drive's life: their attachments need no
 * Get. At a takeover, what an earlier attempt left joining is settled first: made final when
 * its input is in the stream, else put back in the queue (joins_recover_start). Every call is
 * the drive's Store call in flight: the drive parks on it (DRIVE_JOIN_WAIT, DRIVE_RECOVER_WAIT).
 */
#include "drive.h"
#include "failpoint.h"
#include "log.h"
#include "mem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An Append of joined inputs stops growing past this (storaged's requests are at most 16 MiB
 * by default, and one message's text up to 4 MiB). */
#define JOIN_APPEND_BYTES (4 << 20)

static Cflue__V1__SubmissionStatus joining_status =
    CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING;

/* joining_list_request asks for the deliveries JOINING into this host, in admission order. */
/* next_page_of returns a copy of l's next page token, or NULL on its last page (a page ends at
 * storaged's byte budget; an empty page is the last). */
static char *next_page_of(const Cflue__V1__ListResponse *l)
{
    return *l->next_page_token && l->n_submissions ? mem_strdup(l->next_page_token) : NULL;
}

static Cflue__V1__ListRequest joining_list_request(struct drive *d)
{
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    lr.conversation_id = d->sub->conversation_id;
    lr.joined_into = d->sub->submission_id;
    lr.statuses = &joining_status;
    lr.n_statuses = 1;
    lr.page_size = 1000;
    lr.page_token = d->joining.page_token ? d->joining.page_token : "";
    return lr;
}

/* worth_asking: storaged's last answer counted submissions queued behind, or a Submit through
 * this agentd admitted one behind it since (the hint is taken). */
static bool worth_asking(struct drive *d)
{
    pthread_mutex_lock(&g_agentd.mu);
    bool hint = d->act->queued_hint;
    d->act->queued_hint = false;
    pthread_mutex_unlock(&g_agentd.mu);
    return hint || d->queued > 0;
}

/* take_submissions moves the submissions out of a ClaimJoinable or List response into the
 * drive's kept set (their attachments need no Get) and frees the response. */
static void take_submissions(struct drive *d, ProtobufCMessage *resp, Cflue__V1__Submission **subs,
                             size_t *n)
{
    for (size_t i = 0; i < *n; i++) {
        dstore_keep_submission(d, subs[i]);
    }
    *n = 0; /* the response frees its array, not the submissions kept */
    protobuf_c_message_free_unpacked(resp, NULL);
}

/* Where the joining stands (d->joining.phase). */
enum join_phase {
    JOIN_CLAIM,        /* ClaimJoinable in flight */
    JOIN_LIST,         /* List of the deliveries joining into this host in flight */
    JOIN_INPUTS,       /* their inputs being appended */
    JOIN_FINALIZE,     /* FinalizeJoin of d->known[first + next] in flight */
    JOIN_EARLIER,      /* takeover: List of what an earlier attempt left joining */
    JOIN_EARLIER_EACH, /* FinalizeJoin or RevertJoin of earlier->submissions[next] in flight */
};

static void send_claim(struct drive *d)
{
    Cflue__V1__ClaimJoinableRequest req = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    req.host = &d->fence;
    dstore_flight_send(d, "ClaimJoinable", &req.base,
                       &cflue__v1__claim_joinable_response__descriptor, 0);
}

static void send_list(struct drive *d)
{
    Cflue__V1__ListRequest lr = joining_list_request(d);
    dstore_flight_send(d, "List", &lr.base, &cflue__v1__list_response__descriptor, 0);
}

static void send_finalize(struct drive *d)
{
    Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
    jr.host = &d->fence;
    jr.submission_id = d->known[d->joining.first + d->joining.next]->submission_id;
    dstore_flight_send(d, "FinalizeJoin", &jr.base, &cflue__v1__submission__descriptor, 0);
}

bool joins_start(struct drive *d)
{
    if (!worth_asking(d)) {
        return false;
    }
    free(d->joining.page_token);
    memset(&d->joining, 0, sizeof(d->joining));
    d->joining.phase = JOIN_CLAIM;
    send_claim(d);
    return true;
}

/* claimed takes the claim's (or the List's) answer: the deliveries kept, their inputs next. */
static void claimed(struct drive *d, ProtobufCMessage *resp, Cflue__V1__Submission **subs,
                    size_t *n)
{
    d->joining.first = d->n_known;
    d->joining.n = *n;
    d->joining.next = 0;
    take_submissions(d, resp, subs, n);
    d->joining.phase = JOIN_INPUTS;
    if (d->joining.n) {
        failpoint_hit("agentd.join.inputs.before"); /* claimed: JOINING, no input stored */
    }
}

/* take_call takes the end of the joining's call in flight: false while it is in flight (or
 * waits for its retry); else true with rc and resp (freed by the caller; NULL unless rc is
 * CF_OK). */
static bool take_call(struct drive *d, void (*resend)(struct drive *), enum cf_status *rc,
                      ProtobufCMessage **resp)
{
    switch (dstore_flight_take(d, resend, rc, resp)) {
    case FLIGHT_WAITING:
        return false;
    case FLIGHT_IDLE: /* nothing in flight: no answer to go on with */
        *rc = cf_error_set(&d->err, CF_INTERNAL, "storaged: the joining's call was not made");
        return true;
    case FLIGHT_ENDED:
    default:
        return true;
    }
}

/* append_inputs puts the claimed deliveries' inputs in the log (those not there already) and
 * writes them, in Appends of at most JOIN_APPEND_BYTES; true when all are stored. */
static bool append_inputs(struct drive *d)
{
    while (d->joining.next < d->joining.n) {
        if (d->log.pending_bytes > JOIN_APPEND_BYTES && !dstore_stored(d)) {
            return false;
        }
        if (drive_broken(d)) {
            return true;
        }
        const Cflue__V1__Submission *s = d->known[d->joining.first + d->joining.next];
        char id[256];
        snprintf(id, sizeof(id), "input:%s", s->submission_id);
        if (!rlog_find(&d->log, id) && dstore_append_input(d, id, s) != CF_OK) {
            return true;
        }
        d->joining.next++;
    }
    return dstore_stored(d);
}

/* finalized takes a FinalizeJoin's status; false when the joining cannot go on. */
static bool finalized(struct drive *d, enum cf_status rc)
{
    const Cflue__V1__Submission *s = d->known[d->joining.first + d->joining.next];
    if (rc == CF_OK) {
        /* the host's trace; the joined one's own trace id too, so a search by either finds it */
        struct trace_ctx own;
        log_info("joined", "submission=%s host=%s joined_trace_id=%s", s->submission_id,
                 d->sub->submission_id, drive_sub_trace(s, &own) ? own.trace_id : "-");
    } else if (rc == CF_STALE) {
        return false; /* this host's lease is lost: the drive stops */
    } else if (rc != CF_PRECONDITION) {
        /* CF_PRECONDITION: the delivery is no longer joining into this host */
        drive_fault(d, "finishing a join failed", &d->err);
        return false;
    }
    /* its input is in the stream either way: the model answers it now (a delivery that was not
     * finalized goes back to the queue and finds its input already there) */
    d->joining.joined++;
    d->joining.next++;
    return true;
}

void joins_recover_start(struct drive *d)
{
    free(d->joining.page_token);
    memset(&d->joining, 0, sizeof(d->joining));
    d->joining.phase = JOIN_EARLIER;
    send_list(d);
}

/* earlier_landed: the earlier attempt's delivery `next` has its input in the stream. */
static bool earlier_landed(struct drive *d)
{
    char id[256];
    snprintf(id, sizeof(id), "input:%s",
             d->joining.earlier->submissions[d->joining.next]->submission_id);
    return rlog_find(&d->log, id) != NULL;
}

/* send_earlier makes the earlier attempt's delivery `next` final when its input landed, else
 * puts it back in the queue. */
static void send_earlier(struct drive *d)
{
    Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
    jr.host = &d->fence;
    jr.submission_id = d->joining.earlier->submissions[d->joining.next]->submission_id;
    dstore_flight_send(d, earlier_landed(d) ? "FinalizeJoin" : "RevertJoin", &jr.base,
                       &cflue__v1__submission__descriptor, 0);
}

/* earlier_next goes on to the next delivery an earlier attempt left joining: true when none
 * is left (or the drive cannot go on). */
static bool earlier_next(struct drive *d)
{
    if (!drive_broken(d) && d->joining.next >= d->joining.earlier->n_submissions &&
        (d->joining.page_token = next_page_of(d->joining.earlier)) != NULL) {
        /* the next page of them */
        protobuf_c_message_free_unpacked(&d->joining.earlier->base, NULL);
        d->joining.earlier = NULL;
        d->joining.next = 0;
        d->joining.phase = JOIN_EARLIER;
        send_list(d);
        return false;
    }
    if (drive_broken(d) || d->joining.next >= d->joining.earlier->n_submissions) {
        joins_cleanup(d);
        return true;
    }
    send_earlier(d);
    return false;
}

/* earlier_take goes on with the recovery of an earlier attempt's joins as its calls end. */
static bool earlier_take(struct drive *d)
{
    enum cf_status rc;
    ProtobufCMessage *resp;
    if (d->joining.phase == JOIN_EARLIER) {
        if (!take_call(d, send_list, &rc, &resp)) {
            return false;
        }
        if (rc != CF_OK) {
            if (resp) {
                protobuf_c_message_free_unpacked(resp, NULL);
            }
            if (!drive_lost_or_down(d)) {
                drive_fault(d, "listing joining messages failed", &d->err);
            }
            return true;
        }
        d->joining.earlier = (Cflue__V1__ListResponse *)resp;
        free(d->joining.page_token);
        d->joining.page_token = NULL;
        d->joining.phase = JOIN_EARLIER_EACH;
        return earlier_next(d);
    }
    if (!take_call(d, send_earlier, &rc, &resp)) {
        return false;
    }
    if (resp) {
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    bool landed = earlier_landed(d);
    if (rc == CF_OK) {
        log_info(landed ? "join_adopted" : "join_reverted", "submission=%s host=%s",
                 d->joining.earlier->submissions[d->joining.next]->submission_id,
                 d->sub->submission_id);
    } else if (rc != CF_STALE && rc != CF_PRECONDITION) {
        drive_fault(d, "settling a half-joined message failed", &d->err);
    }
    d->joining.next++;
    return earlier_next(d);
}

void joins_cleanup(struct drive *d)
{
    free(d->joining.page_token);
    d->joining.page_token = NULL;
    if (d->joining.earlier) {
        protobuf_c_message_free_unpacked(&d->joining.earlier->base, NULL);
        d->joining.earlier = NULL;
    }
}

bool joins_take(struct drive *d, int *joined)
{
    enum cf_status rc;
    ProtobufCMessage *resp;
    *joined = 0;
    switch (d->joining.phase) {
    case JOIN_EARLIER:
    case JOIN_EARLIER_EACH:
        return earlier_take(d);
    case JOIN_CLAIM:
        if (!take_call(d, send_claim, &rc, &resp)) {
            return false;
        }
        if (rc != CF_OK) {
            break;
        }
        d->queued = 0; /* until an answer counts some again */
        if (d->store_tries > 1) {
            /* an earlier try may have claimed deliveries and lost the answer: they are JOINING
             * into this host too, and come first. Take the whole set, in admission order. */
            protobuf_c_message_free_unpacked(resp, NULL);
            d->joining.phase = JOIN_LIST;
            send_list(d);
            return false;
        }
        Cflue__V1__ClaimJoinableResponse *cr = (Cflue__V1__ClaimJoinableResponse *)resp;
        claimed(d, resp, cr->submissions, &cr->n_submissions);
        return joins_take(d, joined);
    case JOIN_LIST:
        if (!take_call(d, send_list, &rc, &resp)) {
            return false;
        }
        if (rc != CF_OK) {
            break;
        }
        Cflue__V1__ListResponse *l = (Cflue__V1__ListResponse *)resp;
        bool first_page = !d->joining.page_token;
        free(d->joining.page_token);
        d->joining.page_token = next_page_of(l);
        if (first_page) {
            claimed(d, resp, l->submissions, &l->n_submissions);
        } else { /* the next page: kept after the first, in admission order */
            d->joining.n += l->n_submissions;
            take_submissions(d, resp, l->submissions, &l->n_submissions);
        }
        if (d->joining.page_token) {
            d->joining.phase = JOIN_LIST;
            send_list(d);
            return false;
        }
        d->joining.phase = JOIN_INPUTS;
        return joins_take(d, joined);
    case JOIN_INPUTS:
        if (!append_inputs(d)) {
            return false;
        }
        if (drive_broken(d)) {
            return true;
        }
        d->joining.next = 0;
        d->joining.phase = JOIN_FINALIZE;
        if (d->joining.n == 0) {
            return true;
        }
        failpoint_hit("agentd.join.finalize.before"); /* the inputs stored, no join final */
        send_finalize(d);
        return false;
    case JOIN_FINALIZE:
        if (!take_call(d, send_finalize, &rc, &resp)) {
            return false;
        }
        if (resp) {
            protobuf_c_message_free_unpacked(resp, NULL);
        }
        if (finalized(d, rc) && d->joining.next < d->joining.n) {
            send_finalize(d);
            return false;
        }
        *joined = d->joining.joined;
        return true;
    default:
        return true;
    }
    /* the claim or the List failed */
    if (!drive_lost_or_down(d)) {
        drive_fault(d, "claiming joinable messages failed", &d->err);
    }
    return true;
}
