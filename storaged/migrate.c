/* migrate.c - schema version 1 (JSON record bodies) to 2 (typed record bodies), and 2 to 3
 * (Claim through indexes: the `runnable` table), and 3 to 4 (the indexes of List's owner and
 * abort filters), and 4 to 5 (a delegated submission's parent, for the abort cascade), and 5
 * to 6 (the principal owning each conversation), and 6 to 7 (each submission's trace context),
 * and 7 to 8 (each attempt's claimer start), and 8 to 9 (records keyed by rowid).
 *
 * Version 1 stored a record as `type TEXT` + `body TEXT` holding JSON whose shape lived in
 * agentd's code; version 2 stores the Record.body oneof case (`kind`) and the body message
 * packed by protobuf-c. This file is the only place in storaged that parses JSON, and it only
 * runs once per database, inside one transaction with the steps up to version 8.
 */
#include "migrate.h"

#include "arena.h"
#include "clock.h"
#include "db.h"
#include "failpoint.h"
#include "log.h"
#include "record_kind.h"
#include "stmt.h"

#include "cflue/v1/store.pb-c.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LEGACY_KIND_KEY "cflue.kind"

static const char *jstr(struct arena *a, const json_t *o, const char *key)
{
    return arena_strdup(a, json_string_value(json_object_get(o, key)));
}

static int64_t jint(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : (int64_t)json_number_value(v);
}

static void *zalloc(struct arena *a, size_t n)
{
    void *p = arena_alloc(a, n);
    memset(p, 0, n);
    return p;
}

static ProtobufCMessage *user_message(struct arena *a, const json_t *b)
{
    Cflue__V1__UserMessage *m = zalloc(a, sizeof(*m));
    cflue__v1__user_message__init(m);
    m->text = (char *)jstr(a, b, "text");
    const json_t *atts = json_object_get(b, "attachments");
    m->n_attachments = json_array_size(atts);
    m->attachments = zalloc(a, sizeof(void *) * (m->n_attachments + 1));
    for (size_t i = 0; i < m->n_attachments; i++) {
        const json_t *j = json_array_get(atts, i);
        Cflue__V1__AttachmentRef *r = zalloc(a, sizeof(*r));
        cflue__v1__attachment_ref__init(r);
        r->name = (char *)jstr(a, j, "name");
        r->mime_type = (char *)jstr(a, j, "mime_type");
        r->size_bytes = jint(j, "bytes");
        m->attachments[i] = r;
    }
    return &m->base;
}

static ProtobufCMessage *assistant_message(struct arena *a, const json_t *b)
{
    Cflue__V1__AssistantMessage *m = zalloc(a, sizeof(*m));
    cflue__v1__assistant_message__init(m);
    m->turn = (int32_t)jint(b, "turn");
    m->text = (char *)jstr(a, b, "text");
    m->stop_reason = (char *)jstr(a, b, "stop_reason");
    m->model = (char *)jstr(a, b, "model");
    const json_t *calls = json_object_get(b, "tool_calls");
    m->n_tool_calls = json_array_size(calls);
    m->tool_calls = zalloc(a, sizeof(void *) * (m->n_tool_calls + 1));
    for (size_t i = 0; i < m->n_tool_calls; i++) {
        const json_t *j = json_array_get(calls, i);
        Cflue__V1__ToolCallRequest *c = zalloc(a, sizeof(*c));
        cflue__v1__tool_call_request__init(c);
        c->id = (char *)jstr(a, j, "id");
        c->name = (char *)jstr(a, j, "name");
        c->arguments_json = (char *)jstr(a, j, "arguments");
        m->tool_calls[i] = c;
    }
    const json_t *u = json_object_get(b, "usage");
    m->usage = zalloc(a, sizeof(*m->usage));
    cflue__v1__usage__init(m->usage);
    m->usage->input_tokens = jint(u, "input_tokens");
    m->usage->output_tokens = jint(u, "output_tokens");
    m->usage->cost_usd = json_number_value(json_object_get(b, "cost_usd"));
    return &m->base;
}

static Cflue__V1__TruncatedBy truncated_by(const char *s)
{
    static const char *names[] = {"", "lines", "bytes", "matches", "paths"};
    for (int i = 1; s && i < 5; i++) {
        if (!strcmp(s, names[i])) {
            return (Cflue__V1__TruncatedBy)i;
        }
    }
    return CFLUE__V1__TRUNCATED_BY__TRUNCATED_BY_UNSPECIFIED;
}

static ProtobufCMessage *tool_result(struct arena *a, const json_t *b)
{
    Cflue__V1__ToolCallResult *m = zalloc(a, sizeof(*m));
    cflue__v1__tool_call_result__init(m);
    m->turn = (int32_t)jint(b, "turn");
    m->index = (int32_t)jint(b, "index");
    m->tool_call_id = (char *)jstr(a, b, "tool_call_id");
    m->name = (char *)jstr(a, b, "name");
    m->text = (char *)jstr(a, b, "text");
    m->is_error = json_is_true(json_object_get(b, "is_error"));
    m->outcome_unknown = json_is_true(json_object_get(b, "outcome_unknown"));
    const json_t *t = json_object_get(b, "truncation");
    if (json_is_object(t)) {
        Cflue__V1__Truncation *tr = zalloc(a, sizeof(*tr));
        cflue__v1__truncation__init(tr);
        tr->truncated = json_is_true(json_object_get(t, "truncated"));
        tr->by = truncated_by(json_string_value(json_object_get(t, "by")));
        tr->total_lines = jint(t, "total_lines");
        tr->total_bytes = jint(t, "total_bytes");
        tr->shown_first_line = jint(t, "shown_first_line");
        tr->shown_last_line = jint(t, "shown_last_line");
        tr->next_offset = jint(t, "next_offset");
        tr->line_too_long = json_is_true(json_object_get(t, "line_too_long"));
        m->truncation = tr;
    }
    return &m->base;
}

static ProtobufCMessage *compaction(struct arena *a, const json_t *b)
{
    static const char *reasons[] = {"", "threshold", "overflow", "request"};
    Cflue__V1__Compaction *m = zalloc(a, sizeof(*m));
    cflue__v1__compaction__init(m);
    m->summary = (char *)jstr(a, b, "summary");
    m->first_kept_offset = jint(b, "first_kept_offset");
    m->tokens_before = jint(b, "tokens_before");
    m->tokens_after = jint(b, "tokens_after");
    const char *r = json_string_value(json_object_get(b, "reason"));
    for (int i = 1; r && i < 4; i++) {
        if (!strcmp(r, reasons[i])) {
            m->trigger = (Cflue__V1__CompactionTrigger)i;
        }
    }
    return &m->base;
}

static ProtobufCMessage *settled(struct arena *a, const json_t *b)
{
    static const char *outcomes[] = {"", "completed", "failed", "aborted"};
    Cflue__V1__SubmissionSettled *m = zalloc(a, sizeof(*m));
    cflue__v1__submission_settled__init(m);
    const char *o = json_string_value(json_object_get(b, "outcome"));
    for (int i = 1; o && i < 4; i++) {
        if (!strcmp(o, outcomes[i])) {
            m->outcome = (Cflue__V1__Outcome)i;
        }
    }
    m->error = (char *)jstr(a, b, "error");
    m->answered_by = (char *)jstr(a, b, "answered_by");
    return &m->base;
}

static ProtobufCMessage *signal_of(struct arena *a, const char *kind, const char *text)
{
    Cflue__V1__Signal *m = zalloc(a, sizeof(*m));
    cflue__v1__signal__init(m);
    m->kind = arena_strdup(a, kind);
    m->text = arena_strdup(a, text);
    return &m->base;
}

/* legacy keeps a record of a type this version does not know: a Signal "legacy_<type>" (the
 * type cut to fit and reduced to [a-z0-9_]) whose text is the old JSON body. */
static ProtobufCMessage *legacy(struct arena *a, const char *type, const char *json)
{
    char kind[65];
    int n = snprintf(kind, sizeof(kind), "legacy_%s", type);
    n = n < 0 ? 0 : (n >= (int)sizeof(kind) ? (int)sizeof(kind) - 1 : n);
    for (int i = 7; i < n; i++) {
        char c = kind[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
            kind[i] = '_';
        }
    }
    return signal_of(a, kind, json);
}

/* typed_body converts one version-1 record body. Never fails: what it cannot read becomes a
 * legacy Signal, so no record is lost. */
static ProtobufCMessage *typed_body(struct arena *a, const char *type, const char *json)
{
    json_t *b = json_loads(json, 0, NULL);
    ProtobufCMessage *m = NULL;
    if (json_is_object(b)) {
        if (!strcmp(type, "user_message")) {
            m = user_message(a, b);
        } else if (!strcmp(type, "system_prompt")) {
            Cflue__V1__SystemPrompt *p = zalloc(a, sizeof(*p));
            cflue__v1__system_prompt__init(p);
            p->text = (char *)jstr(a, b, "text");
            m = &p->base;
        } else if (!strcmp(type, "assistant_delta")) {
            Cflue__V1__AssistantDelta *d = zalloc(a, sizeof(*d));
            cflue__v1__assistant_delta__init(d);
            d->turn = (int32_t)jint(b, "turn");
            d->text = (char *)jstr(a, b, "text");
            m = &d->base;
        } else if (!strcmp(type, "assistant_message")) {
            m = assistant_message(a, b);
        } else if (!strcmp(type, "tool_result")) {
            m = tool_result(a, b);
        } else if (!strcmp(type, "signal")) {
            m = signal_of(a, jstr(a, b, "type"), jstr(a, b, "text"));
        } else if (!strcmp(type, "compaction")) {
            m = compaction(a, b);
        } else if (!strcmp(type, "submission_settled")) {
            m = settled(a, b);
        }
    }
    json_decref(b);
    return m ? m : legacy(a, type, json);
}

/* migrate_record writes the current row of rd (a version-1 record) into records_v2. */
static enum cf_status migrate_record(struct stmt *rd, sqlite3 *db, struct cf_error *err)
{
    static const char sql[] =
        "INSERT INTO records_v2(conversation_id, pos, record_id, kind, submission_id, "
        "attempt_id, ts, body) VALUES (?,?,?,?,?,?,?,?)";
    struct stmt wr;
    struct arena a;
    enum cf_status rc;
    if ((rc = stmt_open(&wr, db, sql, "migrate a record", err)) != CF_OK) {
        return rc;
    }
    arena_init(&a);
    const char *type = (const char *)sqlite3_column_text(rd->st, 3);
    const char *json = (const char *)sqlite3_column_text(rd->st, 7);
    Cflue__V1__Record rec = CFLUE__V1__RECORD__INIT;
    record_set_body(&rec, typed_body(&a, type ? type : "", json ? json : ""));
    size_t len = protobuf_c_message_get_packed_size(record_body(&rec));
    uint8_t *buf = arena_alloc(&a, len + 1);
    protobuf_c_message_pack(record_body(&rec), buf);
    for (int i = 0; i < 7; i++) {
        if (i != 3) {
            stmt_value(&wr, i + 1, sqlite3_column_value(rd->st, i));
        }
    }
    stmt_int(&wr, 4, (int)rec.body_case);
    stmt_blob(&wr, 8, buf, len);
    rc = stmt_done(&wr, err);
    arena_cleanup(&a);
    return rc;
}

static enum cf_status migrate_records(sqlite3 *db, struct cf_error *err)
{
    static const char sql[] = "SELECT conversation_id, pos, record_id, type, submission_id, "
                              "attempt_id, ts, body FROM records ORDER BY conversation_id, pos";
    struct stmt rd;
    enum cf_status rc;
    bool row;
    if ((rc = db_exec(db, "CREATE TABLE records_v2" DB_RECORDS_TABLE, err)) != CF_OK ||
        (rc = stmt_open_once(&rd, db, sql, "read version-1 records", err)) != CF_OK) {
        return rc;
    }
    while ((rc = stmt_step(&rd, &row, err)) == CF_OK && row &&
           (rc = migrate_record(&rd, db, err)) == CF_OK) {
    }
    stmt_close(&rd);
    if (rc != CF_OK) {
        return rc;
    }
    return db_exec(db, "DROP TABLE records; ALTER TABLE records_v2 RENAME TO records;", err);
}

/* migrate_kinds gives submissions admitted with metadata cflue.kind=compact the kind COMPACT and
 * removes the (now reserved) key from their stored request, so a retried Admit of kind COMPACT
 * with the same idempotency key is recognized as the same request. */
/* migrate_kind rewrites the current row of rd (submission_id, payload) when its stored request
 * carries the legacy key. */
static enum cf_status migrate_kind(struct stmt *rd, sqlite3 *db, struct cf_error *err)
{
    static const char sql[] =
        "UPDATE submissions SET payload = ?, kind = ? WHERE submission_id = ?";
    struct arena a;
    enum cf_status rc = CF_OK;
    arena_init(&a);
    Cflue__V1__AdmitRequest *p = (Cflue__V1__AdmitRequest *)protobuf_c_message_unpack(
        &cflue__v1__admit_request__descriptor, arena_protobuf_allocator(&a),
        (size_t)sqlite3_column_bytes(rd->st, 1), sqlite3_column_blob(rd->st, 1));
    bool compact = false, had = false;
    size_t k = 0;
    for (size_t i = 0; p && i < p->n_metadata; i++) {
        if (!strcmp(p->metadata[i]->key, LEGACY_KIND_KEY)) {
            had = true;
            compact = !strcmp(p->metadata[i]->value, "compact");
        } else {
            p->metadata[k++] = p->metadata[i];
        }
    }
    if (had) { /* else the key was only inside some text: nothing to migrate */
        struct stmt wr;
        p->n_metadata = k;
        if (compact) {
            p->kind = CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT;
            p->message = NULL;
        }
        size_t len = protobuf_c_message_get_packed_size(&p->base);
        uint8_t *buf = arena_alloc(&a, len + 1);
        protobuf_c_message_pack(&p->base, buf);
        if ((rc = stmt_open(&wr, db, sql, "migrate a submission's kind", err)) == CF_OK) {
            stmt_blob(&wr, 1, buf, len);
            stmt_int(&wr, 2,
                     compact ? CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_COMPACT
                             : CFLUE__V1__SUBMISSION_KIND__SUBMISSION_KIND_MESSAGE);
            stmt_value(&wr, 3, sqlite3_column_value(rd->st, 0));
            rc = stmt_done(&wr, err);
        }
    }
    arena_cleanup(&a);
    return rc;
}

/* migrate_kinds gives submissions admitted with metadata cflue.kind=compact the kind COMPACT and
 * removes the (now reserved) key from their stored request, so a retried Admit of kind COMPACT
 * with the same idempotency key is recognized as the same request. */
static enum cf_status migrate_kinds(sqlite3 *db, struct cf_error *err)
{
    static const char sql[] = "SELECT submission_id, payload FROM submissions "
                              "WHERE instr(payload, CAST('" LEGACY_KIND_KEY "' AS BLOB)) > 0";
    struct stmt rd;
    enum cf_status rc;
    bool row;
    if ((rc = db_exec(db,
                      "ALTER TABLE submissions ADD COLUMN kind INTEGER NOT NULL DEFAULT 1 "
                      "CHECK (kind IN (1, 2))",
                      err)) != CF_OK ||
        (rc = stmt_open_once(&rd, db, sql, "read version-1 submissions", err)) != CF_OK) {
        return rc;
    }
    while ((rc = stmt_step(&rd, &row, err)) == CF_OK && row &&
           (rc = migrate_kind(&rd, db, err)) == CF_OK) {
    }
    stmt_close(&rd);
    return rc;
}

/* 4 to 5: no submission of an earlier version was delegated, so every row's parent is NULL,
 * which is what ADD COLUMN gives it. */
static const char parent_sql[] =
    "ALTER TABLE submissions ADD COLUMN " DB_PARENT_COLUMN ";" DB_PARENT_INDEX;

/* 5 to 6: every conversation of an earlier version was created without authentication, so
 * its principal (and its submissions' copy) is NULL, which is what ADD COLUMN gives it. */
static const char principal_sql[] = "ALTER TABLE conversations ADD COLUMN " DB_PRINCIPAL_COLUMN ";"
                                    "ALTER TABLE submissions ADD COLUMN " DB_PRINCIPAL_COLUMN ";";

/* 6 to 7: no submission of an earlier version was admitted with a trace context kept, so its
 * traceparent and tracestate are NULL, which is what ADD COLUMN gives them. */
static const char trace_sql[] = "ALTER TABLE submissions ADD COLUMN " DB_TRACEPARENT_COLUMN ";"
                                "ALTER TABLE submissions ADD COLUMN " DB_TRACESTATE_COLUMN ";";

/* 7 to 8: no attempt of an earlier version recorded its claimer's start, so every row's
 * owner_started_at is 0 (a reclaim compares its started_at then, as before). */
static const char owner_started_sql[] =
    "ALTER TABLE submissions ADD COLUMN " DB_OWNER_STARTED_COLUMN ";";

/* rolled_back ends the open transaction of a failed step and returns its status rc. */
static enum cf_status rolled_back(sqlite3 *db, enum cf_status rc)
{
    struct cf_error ignored;
    if (db_exec(db, "ROLLBACK", &ignored) != CF_OK) {
        /* closing the connection rolls back what is left */
    }
    return rc;
}

/* 8 to 9: the records table keyed by rowid instead of WITHOUT ROWID (db.h says why). The rows
 * move in steps of at most MOVE_STEP_BYTES of bodies or MOVE_STEP_ROWS rows, in the order of
 * their positions; each step copies its rows into records_v9 and deletes them from records in
 * one transaction, so a row is always in exactly one of the two tables. Step by step, the pages
 * the old table frees take the new rows and the WAL is checkpointed: the database file grows by
 * about one step, not by a copy of the records, and the WAL by about two (a step's new rows,
 * and the zeros secure_delete writes over the pages it frees: db.c). Every step stamps
 * MIGRATE_MOVING_STAMP (migrate.h), so a storaged of version 8 never serves a half-moved
 * stream; a move stopped part way (a crash, a full disk) keeps that stamp with both tables,
 * and the next start goes on from there. */
#define MOVE_STEP_BYTES (32 << 20)
#define MOVE_STEP_ROWS 10000

/* move_step_end finds the key (conversation_id, pos) of the last row the next step moves, the
 * id malloc'd into *conv (the caller frees it); *found false when records is empty. */
static enum cf_status move_step_end(sqlite3 *db, char **conv, int64_t *pos, bool *found,
                                    struct cf_error *err)
{
    static const char sql[] =
        "SELECT conversation_id, pos, length(body) FROM records ORDER BY conversation_id, pos";
    struct stmt s;
    bool row;
    int64_t bytes = 0;
    enum cf_status rc = stmt_open(&s, db, sql, "size the next step of records", err);
    *found = false;
    for (int rows = 0; rc == CF_OK && rows < MOVE_STEP_ROWS && bytes < MOVE_STEP_BYTES; rows++) {
        if ((rc = stmt_step(&s, &row, err)) != CF_OK || !row) {
            break;
        }
        const char *id = (const char *)sqlite3_column_text(s.st, 0);
        free(*conv);
        if (!(*conv = strdup(id ? id : ""))) {
            rc = cf_error_set(err, CF_NOMEM, "out of memory sizing a step of records");
            break;
        }
        *pos = sqlite3_column_int64(s.st, 1);
        bytes += sqlite3_column_int64(s.st, 2);
        *found = true;
    }
    stmt_close(&s);
    return rc;
}

/* move_records_step moves one step of rows; *done true (and the tables swapped, the version
 * stamped) when none was left. Runs in its own transaction. */
static enum cf_status move_records_step(sqlite3 *db, bool *done, struct cf_error *err)
{
    static const char copy_sql[] =
        "INSERT INTO records_v9(conversation_id, pos, record_id, kind, submission_id, "
        "attempt_id, ts, body) SELECT conversation_id, pos, record_id, kind, submission_id, "
        "attempt_id, ts, body FROM records WHERE (conversation_id, pos) <= (?1, ?2) "
        "ORDER BY conversation_id, pos";
    static const char delete_sql[] = "DELETE FROM records WHERE (conversation_id, pos) <= (?1, ?2)";
    static const char start_sql[] =
        "CREATE TABLE IF NOT EXISTS records_v9" DB_RECORDS_TABLE ";"
        "UPDATE meta SET value = '" MIGRATE_MOVING_STAMP "' WHERE key = 'schema_version';";
    static const char swap_sql[] = "DROP TABLE records;"
                                   "ALTER TABLE records_v9 RENAME TO records;"
                                   "UPDATE meta SET value = '9' WHERE key = 'schema_version';";
    char *conv = NULL;
    int64_t pos = 0;
    bool rows_left;
    struct stmt s;
    enum cf_status rc;
    *done = false;
    if ((rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if ((rc = db_exec(db, start_sql, err)) != CF_OK ||
        (rc = move_step_end(db, &conv, &pos, &rows_left, err)) != CF_OK) {
        goto fail;
    }
    if (!rows_left) {
        rc = db_exec(db, swap_sql, err);
    } else {
        for (int i = 0; i < 2 && rc == CF_OK; i++) {
            if ((rc = stmt_open(&s, db, i ? delete_sql : copy_sql, "move a step of records",
                                err)) == CF_OK) {
                stmt_text(&s, 1, conv);
                stmt_int(&s, 2, pos);
                rc = stmt_done(&s, err);
            }
        }
        /* a key that does not compare equal to itself once read back (a row storaged did not
         * write: a BLOB id, a pos that is no integer) would move nothing, step after step */
        if (rc == CF_OK && sqlite3_changes(db) == 0) {
            rc = cf_error_set(err, CF_CORRUPT,
                              "a step of the move matched no record: the row of conversation "
                              "%.200s at position %lld is not as storaged writes it",
                              conv, (long long)pos);
        }
    }
    if (rc == CF_OK && (rc = db_exec(db, "COMMIT", err)) == CF_OK) {
        free(conv);
        *done = !rows_left;
        return CF_OK;
    }
fail:
    free(conv);
    return rolled_back(db, rc);
}

static enum cf_status move_records_to_rowid(sqlite3 *db, struct cf_error *err)
{
    bool done = false;
    enum cf_status rc = CF_OK;
    while (rc == CF_OK && !done) {
        rc = move_records_step(db, &done, err);
        failpoint_hit("storaged.migrate.step"); /* a step committed (or failed) */
    }
    return rc;
}

/* migrate_in_one runs the steps from `version` up to 8 in one transaction and stamps
 * `stamp`. */
static enum cf_status migrate_in_one(sqlite3 *db, int version, const char *stamp,
                                     struct cf_error *err)
{
    static const char stamp_sql[] = "UPDATE meta SET value = ? WHERE key = 'schema_version'";
    struct stmt s;
    enum cf_status rc;
    if ((rc = db_exec(db, "BEGIN IMMEDIATE", err)) != CF_OK) {
        return rc;
    }
    if (version <= 1 &&
        ((rc = migrate_kinds(db, err)) != CF_OK || (rc = migrate_records(db, err)) != CF_OK)) {
        goto fail;
    }
    if (version <= 2 && (rc = db_exec(db, DB_RUNNABLE_SCHEMA DB_RUNNABLE_FILL, err)) != CF_OK) {
        goto fail;
    }
    if (version <= 3 && (rc = db_exec(db, DB_LIST_INDEXES, err)) != CF_OK) {
        goto fail;
    }
    if (version <= 4 && (rc = db_exec(db, parent_sql, err)) != CF_OK) {
        goto fail;
    }
    if (version <= 5 && (rc = db_exec(db, principal_sql, err)) != CF_OK) {
        goto fail;
    }
    if (version <= 6 && (rc = db_exec(db, trace_sql, err)) != CF_OK) {
        goto fail;
    }
    if (version <= 7 && (rc = db_exec(db, owner_started_sql, err)) != CF_OK) {
        goto fail;
    }
    if ((rc = stmt_open(&s, db, stamp_sql, "stamp the schema version", err)) != CF_OK) {
        goto fail;
    }
    stmt_text(&s, 1, stamp);
    if ((rc = stmt_done(&s, err)) != CF_OK || (rc = db_exec(db, "COMMIT", err)) != CF_OK) {
        goto fail;
    }
    return CF_OK;
fail:
    return rolled_back(db, rc);
}

/* room_hint writes to out, for a migration stopped by a full disk, what it needs. moving: the
 * 8-to-9 move ran, which wants about three steps (the file grows by one, the WAL by two) and
 * keeps the steps it committed; else the one transaction up to 8 rolled back whole. */
static void room_hint(char *out, size_t len, bool moving)
{
    if (moving) {
        snprintf(out, len,
                 " (the disk is full: the move of the records wants about %d MiB free beside "
                 "the database; make room and start again, it goes on with the records not "
                 "moved yet)",
                 3 * (MOVE_STEP_BYTES >> 20));
    } else {
        snprintf(out, len,
                 " (the disk is full; nothing of it was kept: make room and start "
                 "again)");
    }
}

enum cf_status migrate_from(sqlite3 *db, const char *path, int version, struct cf_error *err)
{
    enum cf_status rc = CF_OK;
    int64_t start = clock_mono_ms();
    /* version 1's records are rewritten in the rowid layout (migrate_records): it goes to 9 at
     * once; every later version moves its records step by step from 8 */
    bool moving = false;
    if (version < 8) {
        rc = migrate_in_one(db, version, version <= 1 ? "9" : "8", err);
    }
    if (rc == CF_OK && version >= 2) {
        moving = true;
        rc = move_records_to_rowid(db, err);
    }
    if (rc != CF_OK) {
        char why[CF_ERROR_MSG_MAX], room[224] = "";
        snprintf(why, sizeof(why), "%s", err->msg);
        if (rc == CF_FULL) {
            room_hint(room, sizeof(room), moving);
        }
        /* the hint before the cause, which may be long (SQL text) and is cut first */
        return cf_error_set(err, rc, "cannot migrate %.200s from schema version %d to %s%s: %s",
                            path, version, DB_SCHEMA_VERSION, room, why);
    }
    char quoted[1024];
    log_info("migrated", "db=%s from_version=%d to_version=%s ms=%lld",
             log_quote(quoted, sizeof(quoted), path), version, DB_SCHEMA_VERSION,
             (long long)(clock_mono_ms() - start));
    return CF_OK;
}
