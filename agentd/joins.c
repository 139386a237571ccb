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
 * Get. An earlier attempt's half-finished joins are settled at takeover (settle.c).
 */
#include "drive.h"
#include "log.h"

#include <stdio.h>
#include <string.h>

/* An Append of joined inputs stops growing past this (storaged's requests are at most 16 MiB
 * by default, and one message's text up to 4 MiB). */
#define JOIN_APPEND_BYTES (4 << 20)

Cflue__V1__ListResponse *joins_list(struct drive *d)
{
    Cflue__V1__ListRequest lr = CFLUE__V1__LIST_REQUEST__INIT;
    Cflue__V1__SubmissionStatus joining = CFLUE__V1__SUBMISSION_STATUS__SUBMISSION_STATUS_JOINING;
    ProtobufCMessage *resp = NULL;
    lr.conversation_id = d->sub->conversation_id;
    lr.joined_into = d->sub->submission_id;
    lr.statuses = &joining;
    lr.n_statuses = 1;
    lr.page_size = 1000;
    if (dstore_call(d, "List", &lr.base, &cflue__v1__list_response__descriptor, &resp) != CF_OK) {
        if (!drive_lost_or_down(d)) {
            drive_fault(d, "listing joining messages failed", &d->err);
        }
        return NULL;
    }
    return (Cflue__V1__ListResponse *)resp;
}

/* finalize_join makes delivery s's join final (its input is in the stream). False when the
 * drive cannot go on joining. */
static bool finalize_join(struct drive *d, const Cflue__V1__Submission *s)
{
    Cflue__V1__JoinRequest jr = CFLUE__V1__JOIN_REQUEST__INIT;
    ProtobufCMessage *jresp = NULL;
    jr.host = &d->fence;
    jr.submission_id = s->submission_id;
    enum cf_status rc =
        dstore_call(d, "FinalizeJoin", &jr.base, &cflue__v1__submission__descriptor, &jresp);
    if (rc == CF_OK) {
        log_info("joined", "submission=%s host=%s", s->submission_id, d->sub->submission_id);
        protobuf_c_message_free_unpacked(jresp, NULL);
    } else if (rc != CF_STALE && rc != CF_PRECONDITION) {
        /* CF_STALE: this host's lease is lost (dstore_call marked it); CF_PRECONDITION: the
         * delivery is no longer joining into this host */
        drive_fault(d, "finishing a join failed", &d->err);
        return false;
    }
    return true;
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

int joins_absorb(struct drive *d)
{
    Cflue__V1__ClaimJoinableRequest req = CFLUE__V1__CLAIM_JOINABLE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    if (!worth_asking(d)) {
        return 0;
    }
    req.host = &d->fence;
    if (dstore_call(d, "ClaimJoinable", &req.base, &cflue__v1__claim_joinable_response__descriptor,
                    &resp) != CF_OK) {
        if (!drive_lost_or_down(d)) {
            drive_fault(d, "claiming joinable messages failed", &d->err);
        }
        return 0;
    }
    d->queued = 0; /* until an answer counts some again */
    Cflue__V1__Submission **subs = ((Cflue__V1__ClaimJoinableResponse *)resp)->submissions;
    size_t *n_field = &((Cflue__V1__ClaimJoinableResponse *)resp)->n_submissions;
    if (d->store_tries > 1) {
        /* an earlier try may have claimed deliveries and lost the answer: they are JOINING
         * into this host too, and come first. Take the whole set, in admission order. */
        protobuf_c_message_free_unpacked(resp, NULL);
        Cflue__V1__ListResponse *l = joins_list(d);
        if (!l) {
            return 0;
        }
        resp = &l->base;
        subs = l->submissions;
        n_field = &l->n_submissions;
    }
    size_t first_kept = d->n_known, n = *n_field;
    take_submissions(d, resp, subs, n_field);
    /* the inputs in as few Appends as the request limit allows (the log may hold some
     * already), then each join made final */
    for (size_t i = 0; i < n; i++) {
        const Cflue__V1__Submission *s = d->known[first_kept + i];
        char id[256];
        snprintf(id, sizeof(id), "input:%s", s->submission_id);
        if (d->log.pending_bytes > JOIN_APPEND_BYTES && dstore_flush(d) != CF_OK) {
            return 0;
        }
        if (!rlog_find(&d->log, id) && dstore_append_input(d, id, s) != CF_OK) {
            return 0;
        }
    }
    if (dstore_flush(d) != CF_OK) {
        return 0;
    }
    int joined = 0;
    for (size_t i = 0; i < n; i++) {
        if (!finalize_join(d, d->known[first_kept + i])) {
            break;
        }
        /* its input is in the stream either way: the model answers it now (a delivery that
         * was not finalized goes back to the queue and finds its input already there) */
        joined++;
    }
    return joined;
}
