/* tokens.c - the Agent API's bearer tokens: the file, the set in force, its reload (tokens.h). */
#include "tokens.h"

#include "file_read.h"
#include "log.h"
#include "mem.h"
#include "yaml_load.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <yaml.h>

#define SHA256_LEN 32
#define AGENT_NAME_MAX 128 /* storaged's limit on an agent name */

struct token {
    char name[IDS_PRINCIPAL_MAX + 1];
    unsigned char sha256[SHA256_LEN];
    char **agents; /* names it may use; "*" is any */
    size_t n_agents;
    bool admin;
    size_t line; /* where the entry starts, for messages */
};

struct token_set {
    struct token *items;
    size_t n;
};

static struct {
    pthread_mutex_t mu;        /* current and the fingerprint */
    pthread_mutex_t reloading; /* one reload at a time */
    struct token_set *current; /* NULL: authentication off */
    char *path;
    uint64_t fingerprint; /* of the file current (or the last failed reload) was read from */
} g_tokens = {.mu = PTHREAD_MUTEX_INITIALIZER, .reloading = PTHREAD_MUTEX_INITIALIZER};

/* ---------- the file ---------- */

static size_t line_of(const yaml_node_t *n)
{
    return n ? n->start_mark.line + 1 : 0;
}

static const char *scalar_of(const yaml_node_t *n)
{
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

static int hex_digit(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* parse_hash reads 64 hex digits into out. */
static bool parse_hash(const char *s, unsigned char out[SHA256_LEN])
{
    if (!s || strlen(s) != SHA256_LEN * 2) {
        return false;
    }
    for (size_t i = 0; i < SHA256_LEN; i++) {
        int hi = hex_digit(s[2 * i]), lo = hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return false;
        }
        out[i] = (unsigned char)(hi << 4 | lo);
    }
    return true;
}

static void token_free(struct token *t)
{
    for (size_t i = 0; i < t->n_agents; i++) {
        free(t->agents[i]);
    }
    free(t->agents);
}

void tokens_set_free(struct token_set *set)
{
    if (!set) {
        return;
    }
    for (size_t i = 0; i < set->n; i++) {
        token_free(&set->items[i]);
    }
    free(set->items);
    free(set);
}

size_t tokens_set_count(const struct token_set *set)
{
    return set ? set->n : 0;
}

/* parse_agents reads an entry's `agents` list. */
static enum cf_status parse_agents(yaml_document_t *doc, yaml_node_t *n, const char *file,
                                   size_t entry, struct token *t, struct cf_error *err)
{
    if (n->type != YAML_SEQUENCE_NODE) {
        return cf_error_set(err, CF_INVALID,
                            "%s:%zu: tokens[%zu].agents: expected a list of agent names (\"*\": "
                            "any)",
                            file, line_of(n), entry);
    }
    size_t count = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    t->agents = mem_alloc(sizeof(char *) * (count + 1));
    for (size_t i = 0; i < count; i++) {
        yaml_node_t *it = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
        const char *v = scalar_of(it);
        if (!v || (strcmp(v, "*") != 0 && !ids_valid_name(v, AGENT_NAME_MAX))) {
            return cf_error_set(err, CF_INVALID,
                                "%s:%zu: tokens[%zu].agents[%zu]: expected an agent name (1 to %d "
                                "of A-Z a-z 0-9 . _ -) or \"*\"",
                                file, line_of(it ? it : n), entry, i, AGENT_NAME_MAX);
        }
        t->agents[t->n_agents++] = mem_strdup(v);
    }
    return CF_OK;
}

/* parse_entry reads one entry of the `tokens` list into t. */
static enum cf_status parse_entry(yaml_document_t *doc, yaml_node_t *n, const char *file,
                                  size_t entry, struct token *t, struct cf_error *err)
{
    enum cf_status rc;
    bool have_name = false, have_hash = false;
    t->line = line_of(n);
    if (n->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID,
                            "%s:%zu: tokens[%zu]: expected a mapping (name, sha256, agents, admin)",
                            file, line_of(n), entry);
    }
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        yaml_node_t *v = yaml_document_get_node(doc, p->value);
        const char *key = scalar_of(k), *val = scalar_of(v);
        if (!key || !v) {
            return cf_error_set(err, CF_INVALID, "%s:%zu: tokens[%zu]: a key must be a string",
                                file, line_of(k ? k : n), entry);
        }
        if (!strcmp(key, "name")) {
            if (!val || !ids_valid_principal(val)) {
                return cf_error_set(err, CF_INVALID,
                                    "%s:%zu: tokens[%zu].name: expected 1 to %d characters of A-Z "
                                    "a-z 0-9 . _ @ -",
                                    file, line_of(v), entry, IDS_PRINCIPAL_MAX);
            }
            snprintf(t->name, sizeof(t->name), "%s", val);
            have_name = true;
        } else if (!strcmp(key, "sha256")) {
            /* the value is a hash, but say nothing of it: it may be a secret pasted by mistake */
            if (!parse_hash(val, t->sha256)) {
                return cf_error_set(err, CF_INVALID,
                                    "%s:%zu: tokens[%zu].sha256: expected the SHA-256 of the "
                                    "token's secret as 64 hex digits (printf %%s \"$SECRET\" | "
                                    "sha256sum, or cflue token hash)",
                                    file, line_of(v), entry);
            }
            have_hash = true;
        } else if (!strcmp(key, "agents")) {
            if ((rc = parse_agents(doc, v, file, entry, t, err)) != CF_OK) {
                return rc;
            }
        } else if (!strcmp(key, "admin")) {
            if (!val || (strcmp(val, "true") != 0 && strcmp(val, "false") != 0)) {
                return cf_error_set(err, CF_INVALID,
                                    "%s:%zu: tokens[%zu].admin: expected true or false", file,
                                    line_of(v), entry);
            }
            t->admin = !strcmp(val, "true");
        } else {
            return cf_error_set(err, CF_INVALID,
                                "%s:%zu: tokens[%zu]: %.64s: unknown key (known: name, sha256, "
                                "agents, admin)",
                                file, line_of(k), entry, key);
        }
    }
    if (!have_name || !have_hash) {
        return cf_error_set(err, CF_INVALID, "%s:%zu: tokens[%zu]: %s is required", file,
                            line_of(n), entry, have_name ? "sha256" : "name");
    }
    return CF_OK;
}

/* check_unique refuses a name or a hash that an earlier entry has. */
static enum cf_status check_unique(const struct token_set *set, const char *file,
                                   struct cf_error *err)
{
    for (size_t i = 0; i < set->n; i++) {
        for (size_t k = 0; k < i; k++) {
            const struct token *a = &set->items[k], *b = &set->items[i];
            if (!strcmp(a->name, b->name)) {
                return cf_error_set(err, CF_INVALID,
                                    "%s:%zu: tokens[%zu].name: '%s' is the name of the entry at "
                                    "line %zu too (names are unique)",
                                    file, b->line, i, b->name, a->line);
            }
            if (!memcmp(a->sha256, b->sha256, SHA256_LEN)) {
                return cf_error_set(
                    err, CF_INVALID,
                    "%s:%zu: tokens[%zu].sha256: the same hash as the entry at line "
                    "%zu (each token needs a secret of its own)",
                    file, b->line, i, a->line);
            }
        }
    }
    return CF_OK;
}

/* parse_root reads the document's `tokens` list into set. */
static enum cf_status parse_root(yaml_document_t *doc, const char *file, struct token_set *set,
                                 struct cf_error *err)
{
    enum cf_status rc;
    yaml_node_t *root = yaml_document_get_root_node(doc);
    yaml_node_t *list = NULL;
    if (!root || root->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID, "%s:%zu: expected a mapping with the key tokens", file,
                            line_of(root));
    }
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        const char *key = scalar_of(k);
        if (!key || strcmp(key, "tokens") != 0) {
            return cf_error_set(err, CF_INVALID, "%s:%zu: %.64s: unknown key (known: tokens)", file,
                                line_of(k), key ? key : "?");
        }
        list = yaml_document_get_node(doc, p->value);
    }
    if (!list || list->type != YAML_SEQUENCE_NODE) {
        return cf_error_set(err, CF_INVALID, "%s:%zu: tokens: expected a list of tokens", file,
                            line_of(list ? list : root));
    }
    size_t count = (size_t)(list->data.sequence.items.top - list->data.sequence.items.start);
    if (count > TOKENS_MAX) {
        return cf_error_set(err, CF_INVALID, "%s: %zu tokens; at most %d", file, count, TOKENS_MAX);
    }
    set->items = mem_alloc(sizeof(*set->items) * (count + 1));
    for (size_t i = 0; i < count; i++) {
        yaml_node_t *it = yaml_document_get_node(doc, list->data.sequence.items.start[i]);
        set->n++; /* counted first: a half-read entry is freed with the set */
        if (!it) {
            return cf_error_set(err, CF_INVALID, "%s: tokens[%zu]: missing", file, i);
        }
        if ((rc = parse_entry(doc, it, file, i, &set->items[i], err)) != CF_OK) {
            return rc;
        }
    }
    return check_unique(set, file, err);
}

enum cf_status tokens_parse(const char *text, size_t len, const char *file, struct token_set **out,
                            struct cf_error *err)
{
    yaml_document_t doc;
    const char *problem;
    size_t line;
    struct token_set *set = mem_alloc(sizeof(*set));
    *out = NULL;
    enum cf_status rc = yaml_load(text, len, &doc, &problem, &line);
    if (rc != CF_OK) {
        /* what libyaml says of a bare * (an alias without a name) */
        bool alias = strstr(problem, "alphabetic or numeric") != NULL;
        rc = cf_error_set(err, CF_INVALID, "%s:%zu: %s%s", file, line + 1, problem,
                          alias ? " (any agent is \"*\", in quotes)" : "");
        tokens_set_free(set);
        return rc;
    }
    rc = parse_root(&doc, file, set, err);
    yaml_document_delete(&doc);
    if (rc != CF_OK) {
        tokens_set_free(set);
        return rc;
    }
    *out = set;
    return CF_OK;
}

/* fingerprint names the file's state: its size, times and inode (through links). */
static uint64_t fingerprint(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        return ids_hash64_more(IDS_HASH64_INIT, "?", 1); /* missing: a state too */
    }
    int64_t v[] = {(int64_t)st.st_size,        (int64_t)st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
                   (int64_t)st.st_ctim.tv_sec, st.st_ctim.tv_nsec,         (int64_t)st.st_ino};
    return ids_hash64_more(IDS_HASH64_INIT, v, sizeof(v));
}

/* load reads and parses path (a FIFO or a device is refused, never waited on). */
static enum cf_status load(const char *path, struct token_set **out, struct cf_error *err)
{
    char *text;
    size_t n;
    enum cf_status rc = file_read_regular(path, TOKENS_FILE_MAX, 0, &text, &n, err);
    if (rc != CF_OK) {
        return rc;
    }
    rc = tokens_parse(text, n, path, out, err);
    free(text);
    return rc;
}

/* ---------- the set in force ---------- */

enum cf_status tokens_start(const char *path, struct cf_error *err)
{
    if (!path || !*path) {
        return CF_OK;
    }
    struct token_set *set;
    uint64_t print = fingerprint(path);
    enum cf_status rc = load(path, &set, err);
    if (rc != CF_OK) {
        return rc;
    }
    pthread_mutex_lock(&g_tokens.mu);
    g_tokens.path = mem_strdup(path);
    g_tokens.current = set;
    g_tokens.fingerprint = print;
    pthread_mutex_unlock(&g_tokens.mu);
    return CF_OK;
}

bool tokens_enabled(void)
{
    pthread_mutex_lock(&g_tokens.mu);
    bool on = g_tokens.current != NULL;
    pthread_mutex_unlock(&g_tokens.mu);
    return on;
}

size_t tokens_count(void)
{
    pthread_mutex_lock(&g_tokens.mu);
    size_t n = tokens_set_count(g_tokens.current);
    pthread_mutex_unlock(&g_tokens.mu);
    return n;
}

bool tokens_changed(void)
{
    pthread_mutex_lock(&g_tokens.mu);
    uint64_t was = g_tokens.fingerprint;
    const char *path = g_tokens.path; /* set once at start, freed only by tokens_stop */
    pthread_mutex_unlock(&g_tokens.mu);
    return path && fingerprint(path) != was;
}

bool tokens_reload(const char *why)
{
    struct token_set *set = NULL;
    struct cf_error err;
    char q[CF_ERROR_MSG_MAX + 64];
    if (!tokens_enabled()) {
        return false;
    }
    pthread_mutex_lock(&g_tokens.reloading);
    uint64_t print = fingerprint(g_tokens.path);
    enum cf_status rc = load(g_tokens.path, &set, &err);
    pthread_mutex_lock(&g_tokens.mu);
    g_tokens.fingerprint = print; /* a bad file is not tried again until it changes */
    struct token_set *old = NULL;
    size_t n = 0;
    if (rc == CF_OK) {
        old = g_tokens.current;
        g_tokens.current = set;
        n = set->n;
    }
    pthread_mutex_unlock(&g_tokens.mu);
    tokens_set_free(old);
    if (rc != CF_OK) {
        log_error("tokens_reload_failed", "why=%s err=%s note=\"the tokens in force stay\"", why,
                  log_quote(q, sizeof(q), err.msg));
    } else {
        log_info("tokens_reloaded", "why=%s tokens=%zu", why, n);
    }
    pthread_mutex_unlock(&g_tokens.reloading);
    return rc == CF_OK;
}

void tokens_stop(void)
{
    pthread_mutex_lock(&g_tokens.mu);
    struct token_set *set = g_tokens.current;
    g_tokens.current = NULL;
    char *path = g_tokens.path;
    g_tokens.path = NULL;
    pthread_mutex_unlock(&g_tokens.mu);
    tokens_set_free(set);
    free(path);
}

/* ---------- callers ---------- */

/* bearer finds the secret of "Bearer <secret>" (the scheme in any case, then spaces): printable
 * ASCII without spaces, 1 to TOKENS_SECRET_MAX bytes. */
static bool bearer(const char *v, const char **secret, size_t *len)
{
    if (strncasecmp(v, "bearer ", 7) != 0) {
        return false;
    }
    const char *s = v + 7;
    while (*s == ' ') {
        s++;
    }
    size_t n = 0;
    for (; s[n]; n++) {
        if (s[n] <= ' ' || s[n] > '~') {
            return false;
        }
    }
    *secret = s;
    *len = n;
    return n >= 1 && n <= TOKENS_SECRET_MAX;
}

enum cf_status tokens_authenticate(const char *authorization, struct principal *out,
                                   struct cf_error *err)
{
    const char *secret;
    size_t len;
    unsigned char digest[SHA256_LEN];
    unsigned int digest_len = 0;
    memset(out, 0, sizeof(*out));
    if (!tokens_enabled()) {
        return CF_OK;
    }
    if (!authorization || !*authorization) {
        return cf_error_set(err, CF_UNAUTHENTICATED,
                            "this agentd needs a bearer token: send the request metadata "
                            "'authorization: Bearer <token>' (cflue: CFLUE_TOKEN)");
    }
    if (!bearer(authorization, &secret, &len)) {
        return cf_error_set(err, CF_UNAUTHENTICATED,
                            "the authorization metadata is not 'Bearer <token>' with a token of 1 "
                            "to %d printable characters",
                            TOKENS_SECRET_MAX);
    }
    if (!EVP_Digest(secret, len, digest, &digest_len, EVP_sha256(), NULL) ||
        digest_len != SHA256_LEN) {
        return cf_error_set(err, CF_INTERNAL, "cannot compute SHA-256 (libcrypto failed)");
    }
    bool found = false;
    pthread_mutex_lock(&g_tokens.mu);
    const struct token_set *set = g_tokens.current;
    /* every entry is compared, in constant time each: the time taken says nothing of which
     * entry (or how much of a digest) matched */
    for (size_t i = 0; set && i < set->n; i++) {
        bool match = CRYPTO_memcmp(digest, set->items[i].sha256, SHA256_LEN) == 0;
        if (match && !found) {
            snprintf(out->name, sizeof(out->name), "%s", set->items[i].name);
            out->admin = set->items[i].admin;
            found = true;
        }
    }
    pthread_mutex_unlock(&g_tokens.mu);
    OPENSSL_cleanse(digest, sizeof(digest));
    if (!found) {
        return cf_error_set(err, CF_UNAUTHENTICATED,
                            "the bearer token is not one this agentd knows (mistyped, revoked, or "
                            "of another deployment)");
    }
    return CF_OK;
}

bool tokens_allow_agent(const struct principal *p, const char *agent)
{
    if (!*p->name) {
        return true; /* authentication is off */
    }
    bool allowed = false;
    pthread_mutex_lock(&g_tokens.mu);
    const struct token_set *set = g_tokens.current;
    for (size_t i = 0; set && i < set->n && !allowed; i++) {
        const struct token *t = &set->items[i];
        if (strcmp(t->name, p->name) != 0) {
            continue;
        }
        for (size_t k = 0; k < t->n_agents && !allowed; k++) {
            allowed = !strcmp(t->agents[k], "*") || !strcmp(t->agents[k], agent);
        }
        break;
    }
    pthread_mutex_unlock(&g_tokens.mu);
    return allowed;
}

bool tokens_owns(const struct principal *p, const char *owner)
{
    return !*p->name || p->admin || !strcmp(owner, p->name);
}
