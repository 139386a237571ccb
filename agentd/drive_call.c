/* drive_call.c - a unary call a parked drive waits on.
 *
 * The call runs on rpc's client loop (rpc_acall_start) and holds no engine thread; its end is
 * kept under the call's lock and posts the drive, whose next step takes it. The drive's Store
 * writes (drive_store.c) and its first turn's call to toold (prompt.c) go this way.
 */
#include "drive.h"
#include "engine.h"

#include <assert.h>
#include <string.h>

void dcall_init(struct drive_call *c, struct drive *d)
{
    memset(c, 0, sizeof(*c));
    c->d = d;
    pthread_mutex_init(&c->mu, NULL);
}

void dcall_cleanup(struct drive_call *c)
{
    assert(!c->in_flight); /* drive_run ends a drive only with no call in flight */
    if (c->resp) {
        protobuf_c_message_free_unpacked(c->resp, NULL);
        c->resp = NULL;
    }
    pthread_mutex_destroy(&c->mu);
}

/* on_end (rpc's client loop) keeps the call's end and posts the drive. */
static void on_end(void *arg, const struct rpc_status *st, ProtobufCMessage *resp)
{
    struct drive_call *c = arg;
    pthread_mutex_lock(&c->mu);
    c->ended = true;
    c->st = *st;
    c->resp = resp;
    /* posted under the lock: once an engine thread sees `ended` the drive may finish and be
     * freed, so nothing here may touch c after the unlock */
    engine_post_unlock(c->d, &c->mu);
}

void dcall_start(struct drive_call *c, struct rpc_channel *ch, const char *path,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                 int64_t timeout_ms)
{
    assert(!c->in_flight);
    c->in_flight = true;
    rpc_acall_start(ch, path, req, resp_desc, timeout_ms, on_end, c);
}

void dcall_post(void *drive)
{
    engine_post(drive);
}

bool dcall_take(struct drive_call *c, struct rpc_status *st, ProtobufCMessage **resp)
{
    *resp = NULL;
    pthread_mutex_lock(&c->mu);
    bool ended = c->ended;
    if (ended) {
        *st = c->st;
        *resp = c->resp;
        c->ended = false;
        c->resp = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (ended) {
        c->in_flight = false;
    }
    return ended;
}
