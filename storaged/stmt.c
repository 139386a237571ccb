/* stmt.c - the per-connection statement cache and the checked bind/step helpers.
 *
 * A cache is an open-addressing table of slots keyed by the SQL text's address, reached from
 * the connection through a small process-wide registry (SQLite 3.40 has no client-data slot
 * on a connection). The registry lock is held only for the lookup; a cache itself is touched
 * only by the thread that holds its connection (storaged never shares a connection between
 * threads at once), so lending out statements needs no lock.
 */
#include "stmt.h"

#include "db.h"
#include "mem.h"

#include <assert.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct stmt_slot {
    const char *sql; /* the key: the SQL text's address; NULL for an empty slot */
    sqlite3_stmt *st;
    bool busy; /* lent out between stmt_open and stmt_close */
};

struct stmt_cache {
    sqlite3 *db;
    struct stmt_slot **slots; /* each slot on its own, so a lent-out one never moves */
    size_t cap, n;            /* cap is a power of two, n <= cap / 2 */
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stmt_cache **reg;
static size_t reg_n, reg_cap;

static struct stmt_cache *cache_of(sqlite3 *db)
{
    struct stmt_cache *c = NULL;
    pthread_mutex_lock(&reg_mu);
    for (size_t i = 0; i < reg_n && !c; i++) {
        c = reg[i]->db == db ? reg[i] : NULL;
    }
    pthread_mutex_unlock(&reg_mu);
    return c;
}

/* on_close runs inside sqlite3_close before SQLite checks for unfinalized statements: the
 * cache finalizes its statements and leaves the registry, so the close succeeds. */
static int on_close(unsigned type, void *arg, void *p, void *x)
{
    struct stmt_cache *c = arg;
    (void)p;
    (void)x;
    if (type != SQLITE_TRACE_CLOSE) {
        return 0;
    }
    pthread_mutex_lock(&reg_mu);
    for (size_t i = 0; i < reg_n; i++) {
        if (reg[i] == c) {
            reg[i] = reg[--reg_n];
            break;
        }
    }
    pthread_mutex_unlock(&reg_mu);
    for (size_t i = 0; i < c->cap; i++) {
        if (c->slots[i]) {
            sqlite3_finalize(c->slots[i]->st);
            free(c->slots[i]);
        }
    }
    free(c->slots);
    free(c);
    return 0;
}

void stmt_cache_attach(sqlite3 *db)
{
    if (cache_of(db)) {
        return;
    }
    struct stmt_cache *c = mem_alloc(sizeof(*c));
    c->db = db;
    c->cap = 64;
    c->n = 0;
    c->slots = mem_alloc(sizeof(*c->slots) * c->cap);
    memset(c->slots, 0, sizeof(*c->slots) * c->cap);
    pthread_mutex_lock(&reg_mu);
    if (reg_n == reg_cap) {
        reg_cap = reg_cap ? reg_cap * 2 : 16;
        reg = mem_realloc(reg, sizeof(*reg) * reg_cap);
    }
    reg[reg_n++] = c;
    pthread_mutex_unlock(&reg_mu);
    sqlite3_trace_v2(db, SQLITE_TRACE_CLOSE, on_close, c);
}

size_t stmt_cache_size(sqlite3 *db)
{
    struct stmt_cache *c = cache_of(db);
    return c ? c->n : 0;
}

static size_t hash(const char *sql, size_t cap)
{
    uintptr_t h = (uintptr_t)sql;
    h ^= h >> 17;
    h *= (uintptr_t)0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 7) & (cap - 1);
}

/* find returns where sql's slot is in the table, or the empty entry where it belongs. */
static struct stmt_slot **find(struct stmt_cache *c, const char *sql)
{
    size_t i = hash(sql, c->cap);
    while (c->slots[i] && c->slots[i]->sql != sql) {
        i = (i + 1) & (c->cap - 1);
    }
    return &c->slots[i];
}

static void grow(struct stmt_cache *c)
{
    struct stmt_slot **old = c->slots;
    size_t old_cap = c->cap;
    c->cap *= 2;
    c->slots = mem_alloc(sizeof(*c->slots) * c->cap);
    memset(c->slots, 0, sizeof(*c->slots) * c->cap);
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i]) {
            *find(c, old[i]->sql) = old[i];
        }
    }
    free(old);
}

static enum cf_status compile(sqlite3 *db, const char *sql, unsigned flags, sqlite3_stmt **out,
                              const char *what, struct cf_error *err)
{
    if (sqlite3_prepare_v3(db, sql, -1, flags, out, NULL) != SQLITE_OK) {
        *out = NULL;
        return db_fail(db, what, err);
    }
    return CF_OK;
}

enum cf_status stmt_open_once(struct stmt *s, sqlite3 *db, const char *sql, const char *what,
                              struct cf_error *err)
{
    s->db = db;
    s->what = what;
    s->slot = NULL;
    return compile(db, sql, 0, &s->st, what, err);
}

enum cf_status stmt_open(struct stmt *s, sqlite3 *db, const char *sql, const char *what,
                         struct cf_error *err)
{
    struct stmt_cache *c = cache_of(db);
    if (!c) {
        return stmt_open_once(s, db, sql, what, err);
    }
    struct stmt_slot *slot = *find(c, sql);
    if (slot && slot->busy) {
        return stmt_open_once(s, db, sql, what, err); /* nested use of the same statement */
    }
    if (!slot) {
        sqlite3_stmt *st;
        enum cf_status rc = compile(db, sql, SQLITE_PREPARE_PERSISTENT, &st, what, err);
        if (rc != CF_OK) {
            s->st = NULL;
            s->slot = NULL;
            return rc;
        }
        if (2 * (c->n + 1) > c->cap) {
            grow(c);
        }
        slot = mem_alloc(sizeof(*slot));
        slot->sql = sql;
        slot->st = st;
        slot->busy = false;
        *find(c, sql) = slot;
        c->n++;
    }
    assert(sqlite3_stmt_busy(slot->st) == 0); /* every use ends with stmt_close's reset */
    slot->busy = true;
    s->db = db;
    s->st = slot->st;
    s->what = what;
    s->slot = slot;
    return CF_OK;
}

void stmt_text(struct stmt *s, int i, const char *v)
{
    sqlite3_bind_text(s->st, i, v ? v : "", -1, SQLITE_STATIC);
}

void stmt_opt_text(struct stmt *s, int i, const char *v)
{
    if (v && *v) {
        sqlite3_bind_text(s->st, i, v, -1, SQLITE_STATIC);
    } else {
        sqlite3_bind_null(s->st, i);
    }
}

void stmt_int(struct stmt *s, int i, int64_t v)
{
    sqlite3_bind_int64(s->st, i, v);
}

void stmt_double(struct stmt *s, int i, double v)
{
    sqlite3_bind_double(s->st, i, v);
}

void stmt_blob(struct stmt *s, int i, const void *v, size_t len)
{
    sqlite3_bind_blob64(s->st, i, v ? v : "", (sqlite3_uint64)len, SQLITE_STATIC);
}

void stmt_value(struct stmt *s, int i, const sqlite3_value *v)
{
    sqlite3_bind_value(s->st, i, v);
}

enum cf_status stmt_step(struct stmt *s, bool *row_out, struct cf_error *err)
{
    int rc = sqlite3_step(s->st);
    *row_out = rc == SQLITE_ROW;
    if (rc == SQLITE_ROW || rc == SQLITE_DONE) {
        return CF_OK;
    }
    return db_step_fail(s->db, rc, s->what, err);
}

enum cf_status stmt_done(struct stmt *s, struct cf_error *err)
{
    bool row;
    enum cf_status rc = stmt_step(s, &row, err);
    if (rc == CF_OK && row) {
        rc = cf_error_set(err, CF_INTERNAL, "%s returned a row", s->what);
    }
    stmt_close(s);
    return rc;
}

enum cf_status stmt_run(sqlite3 *db, const char *sql, struct cf_error *err)
{
    struct stmt s;
    enum cf_status rc = stmt_open(&s, db, sql, sql, err);
    return rc == CF_OK ? stmt_done(&s, err) : rc;
}

int stmt_changes(const struct stmt *s)
{
    return sqlite3_changes(s->db);
}

void stmt_close(struct stmt *s)
{
    if (!s->st) {
        return;
    }
    if (s->slot) {
        assert(s->slot->busy && s->slot->st == s->st);
        sqlite3_reset(s->st); /* its result was reported by the step that failed */
        sqlite3_clear_bindings(s->st);
        s->slot->busy = false;
    } else {
        sqlite3_finalize(s->st);
    }
    s->st = NULL;
    s->slot = NULL;
}
