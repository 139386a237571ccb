/* agents.c - loading agent definitions with libyaml. */
#include "agents.h"

#include "buf.h"
#include "file_read.h"
#include "ids.h"
#include "mem.h"
#include "placement.h"
#include "yaml_load.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#define AGENT_FILE_MAX (1 << 20)

static yaml_node_t *map_get(yaml_document_t *doc, yaml_node_t *map, const char *key)
{
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp((char *)k->data.scalar.value, key)) {
            return yaml_document_get_node(doc, p->value);
        }
    }
    return NULL;
}

static enum cf_status scalar(yaml_node_t *n, const char *file, const char *field, char **out,
                             struct cf_error *err)
{
    if (!n) {
        return CF_OK;
    }
    if (n->type != YAML_SCALAR_NODE) {
        return cf_error_set(err, CF_INVALID, "%s: %s: expected a string", file, field);
    }
    *out = mem_strdup((char *)n->data.scalar.value);
    return CF_OK;
}

static enum cf_status integer(yaml_node_t *n, const char *file, const char *field, int64_t min,
                              int64_t max, int64_t *out, struct cf_error *err)
{
    if (!n) {
        return CF_OK;
    }
    char *end;
    const char *v = n->type == YAML_SCALAR_NODE ? (char *)n->data.scalar.value : "";
    long long x = strtoll(v, &end, 10);
    if (n->type != YAML_SCALAR_NODE || !*v || *end || x < min || x > max) {
        return cf_error_set(err, CF_INVALID, "%s: %s: expected a whole number from %lld to %lld",
                            file, field, (long long)min, (long long)max);
    }
    *out = x;
    return CF_OK;
}

static enum cf_status string_list(yaml_document_t *doc, yaml_node_t *n, const char *file,
                                  const char *field, char ***out, size_t *n_out,
                                  struct cf_error *err)
{
    if (!n) {
        return CF_OK;
    }
    if (n->type != YAML_SEQUENCE_NODE) {
        return cf_error_set(err, CF_INVALID, "%s: %s: expected a list of strings", file, field);
    }
    size_t count = (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
    *out = mem_alloc(sizeof(char *) * (count + 1));
    for (size_t i = 0; i < count; i++) {
        yaml_node_t *it = yaml_document_get_node(doc, n->data.sequence.items.start[i]);
        if (!it || it->type != YAML_SCALAR_NODE || !*(char *)it->data.scalar.value) {
            return cf_error_set(err, CF_INVALID, "%s: %s[%zu]: expected a non-empty string", file,
                                field, i);
        }
        (*out)[(*n_out)++] = mem_strdup((char *)it->data.scalar.value);
    }
    return CF_OK;
}

static const char *const known_keys[] = {"name",       "description", "model",  "sandbox",
                                         "agents",     "mcp",         "skills", "tools",
                                         "compaction", "durability"};

/* split_frontmatter finds the YAML frontmatter between the leading '---' lines and the body
 * after it. */
static enum cf_status split_frontmatter(const char *text, const char *file, const char **fm,
                                        size_t *fm_len, const char **body, struct cf_error *err)
{
    if (strncmp(text, "---\n", 4) != 0 && strncmp(text, "---\r\n", 5) != 0) {
        return cf_error_set(err, CF_INVALID,
                            "%s: the file must start with YAML frontmatter between '---' lines",
                            file);
    }
    const char *start = strchr(text, '\n') + 1;
    const char *end = strstr(start, "\n---");
    if (!end && !strncmp(start, "---", 3)) {
        end = start - 1;
    }
    if (!end) {
        return cf_error_set(err, CF_INVALID, "%s: the frontmatter has no closing '---' line", file);
    }
    const char *b = strchr(end + 1, '\n');
    b = b ? b + 1 : end + strlen(end);
    while (*b == '\n' || *b == '\r') {
        b++;
    }
    *fm = start;
    *fm_len = end > start ? (size_t)(end - start) : 0;
    *body = b;
    return CF_OK;
}

/* check_known_fields refuses a field of the mapping m (the frontmatter, or the mapping at
 * `where`) that is not one of the n known ones, naming them. */
static enum cf_status check_known_fields(yaml_document_t *doc, yaml_node_t *m, const char *file,
                                         const char *where, const char *const *known, size_t n,
                                         struct cf_error *err)
{
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        const char *name = k && k->type == YAML_SCALAR_NODE ? (char *)k->data.scalar.value : "?";
        bool found = false;
        for (size_t i = 0; i < n && !found; i++) {
            found = !strcmp(name, known[i]);
        }
        if (!found) {
            char list[256] = "";
            for (size_t i = 0, len = 0; i < n && len < sizeof(list); i++) {
                len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", i ? ", " : "",
                                        known[i]);
            }
            return cf_error_set(err, CF_INVALID, "%s: %s%s%.64s: unknown field (known: %s)", file,
                                where, *where ? "." : "", name, list);
        }
    }
    return CF_OK;
}

/* parse_identity reads name (defaulting to the file's stem), description and model. */
static enum cf_status parse_identity(yaml_document_t *doc, yaml_node_t *root, const char *name_hint,
                                     const char *file, struct agent_def *a, struct cf_error *err)
{
    enum cf_status rc;
    if ((rc = scalar(map_get(doc, root, "name"), file, "name", &a->name, err)) != CF_OK ||
        (rc = scalar(map_get(doc, root, "description"), file, "description", &a->description,
                     err)) != CF_OK ||
        (rc = scalar(map_get(doc, root, "model"), file, "model", &a->model, err)) != CF_OK) {
        return rc;
    }
    if (!a->name) {
        a->name = mem_strdup(name_hint);
    } else if (name_hint && strcmp(a->name, name_hint) != 0) {
        return cf_error_set(err, CF_INVALID, "%s: name: '%s' does not match the file name '%s.md'",
                            file, a->name, name_hint);
    }
    if (!ids_valid_name(a->name, 128)) {
        return cf_error_set(err, CF_INVALID, "%s: name: use 1 to 128 of A-Z a-z 0-9 . _ -", file);
    }
    if (!a->model) {
        return CF_OK; /* runs with its parent's model: a subagent only */
    }
    size_t plen;
    struct cf_error why;
    if ((rc = agents_model_check(a->model, &plen, &why)) != CF_OK) {
        return cf_error_set(err, rc, "%s: model: %s", file, why.msg);
    }
    a->provider = mem_strndup(a->model, plen);
    a->model_id = mem_strdup(a->model + plen + 1);
    return CF_OK;
}

enum cf_status agents_model_check(const char *model, size_t *provider_len, struct cf_error *err)
{
    const char *slash = strchr(model, '/');
    if (!slash || slash == model || !slash[1]) {
        return cf_error_set(err, CF_INVALID, "'%.300s' must be provider/model-id", model);
    }
    if (strlen(model) > AGENT_MODEL_MAX) {
        return cf_error_set(err, CF_INVALID, "longer than %d characters", AGENT_MODEL_MAX);
    }
    *provider_len = (size_t)(slash - model);
    if (strncmp(model, "anthropic/", 10) != 0 && strncmp(model, "openai/", 7) != 0) {
        return cf_error_set(err, CF_INVALID, "unknown provider '%.*s' (anthropic or openai)",
                            (int)(*provider_len > 64 ? 64 : *provider_len), model);
    }
    return CF_OK;
}

/* parse_sandbox_limits reads sandbox.limits: {cpu_s, memory_mib, procs, file_mib, disk_mib},
 * each optional, each tightening toold's own bound (CommandLimits). */
static enum cf_status parse_sandbox_limits(yaml_document_t *doc, yaml_node_t *sb, const char *file,
                                           struct agent_def *a, struct cf_error *err)
{
    static const char *const keys[] = {"cpu_s", "memory_mib", "procs", "file_mib", "disk_mib"};
    yaml_node_t *l = map_get(doc, sb, "limits");
    if (!l) {
        return CF_OK;
    }
    if (l->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID,
                            "%s: sandbox.limits: expected {cpu_s, memory_mib, procs, file_mib, "
                            "disk_mib}",
                            file);
    }
    struct agent_limits *o = &a->sandbox_limits;
    enum cf_status rc;
    if ((rc = check_known_fields(doc, l, file, "sandbox.limits", keys, 5, err)) != CF_OK ||
        (rc = integer(map_get(doc, l, "cpu_s"), file, "sandbox.limits.cpu_s", 1, 86400 * 30,
                      &o->cpu_s, err)) != CF_OK ||
        (rc = integer(map_get(doc, l, "memory_mib"), file, "sandbox.limits.memory_mib", 1, 1 << 30,
                      &o->memory_mib, err)) != CF_OK ||
        (rc = integer(map_get(doc, l, "procs"), file, "sandbox.limits.procs", 1, 1 << 20, &o->procs,
                      err)) != CF_OK ||
        (rc = integer(map_get(doc, l, "file_mib"), file, "sandbox.limits.file_mib", 1, 1 << 30,
                      &o->file_mib, err)) != CF_OK ||
        (rc = integer(map_get(doc, l, "disk_mib"), file, "sandbox.limits.disk_mib", 1, 1 << 30,
                      &o->disk_mib, err)) != CF_OK) {
        return rc;
    }
    return CF_OK;
}

/* sandbox_replicas reads sandbox.tools: one address, a dns: name, or a list of replicas (kept
 * joined with commas: the spec placement.h reads), checked. */
static enum cf_status sandbox_replicas(yaml_document_t *doc, yaml_node_t *n, const char *file,
                                       struct agent_def *a, struct cf_error *err)
{
    enum cf_status rc;
    if (!n || n->type != YAML_SEQUENCE_NODE) {
        rc = scalar(n, file, "sandbox.tools", &a->sandbox_tools, err);
    } else {
        char **list = NULL;
        size_t k = 0;
        rc = string_list(doc, n, file, "sandbox.tools", &list, &k, err);
        struct buf joined;
        buf_init(&joined, (size_t)PLACEMENT_REPLICAS_MAX * (PLACEMENT_ADDRESS_MAX + 1) * 2);
        for (size_t i = 0; i < k; i++) {
            if (rc == CF_OK && strchr(list[i], ',')) {
                rc = cf_error_set(err, CF_INVALID, "%s: sandbox.tools[%zu]: '%.200s' holds a ','",
                                  file, i, list[i]);
            }
            buf_printf(&joined, "%s%s", i ? "," : "", list[i]);
            free(list[i]);
        }
        free(list);
        if (rc == CF_OK && k == 0) {
            rc = cf_error_set(err, CF_INVALID, "%s: sandbox.tools: an empty list", file);
        }
        if (rc == CF_OK) {
            a->sandbox_tools = mem_strdup(buf_cstr(&joined));
        }
        buf_cleanup(&joined);
    }
    char why[300];
    if (rc == CF_OK && a->sandbox_tools &&
        placement_check(a->sandbox_tools, why, sizeof(why)) != CF_OK) {
        rc = cf_error_set(err, CF_INVALID, "%s: sandbox.tools: %s", file, why);
    }
    return rc;
}

/* parse_sandbox reads the optional sandbox: {tools: ADDRESS, workspace: NAME, limits: {...}}. */
static enum cf_status parse_sandbox(yaml_document_t *doc, yaml_node_t *root, const char *file,
                                    struct agent_def *a, struct cf_error *err)
{
    enum cf_status rc;
    yaml_node_t *sb = map_get(doc, root, "sandbox");
    if (!sb) {
        return CF_OK;
    }
    static const char *const keys[] = {"tools", "workspace", "limits"};
    if (sb->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID,
                            "%s: sandbox: expected {tools: ADDRESS, workspace: NAME}", file);
    }
    if ((rc = check_known_fields(doc, sb, file, "sandbox", keys, 3, err)) != CF_OK ||
        (rc = parse_sandbox_limits(doc, sb, file, a, err)) != CF_OK) {
        return rc;
    }
    if ((rc = sandbox_replicas(doc, map_get(doc, sb, "tools"), file, a, err)) != CF_OK ||
        (rc = scalar(map_get(doc, sb, "workspace"), file, "sandbox.workspace",
                     &a->sandbox_workspace, err)) != CF_OK) {
        return rc;
    }
    if (!a->sandbox_tools) {
        return cf_error_set(err, CF_INVALID, "%s: sandbox.tools: required (toold address)", file);
    }
    if (!a->sandbox_workspace) {
        a->sandbox_workspace = mem_strdup(a->name);
    }
    if (strcmp(a->sandbox_workspace, "{conversation}") &&
        !ids_valid_name(a->sandbox_workspace, 128)) {
        return cf_error_set(err, CF_INVALID,
                            "%s: sandbox.workspace: '%.200s' is neither {conversation} (a "
                            "workspace per conversation) nor a sandbox name (1 to 128 of A-Z a-z "
                            "0-9 . _ -, not . or ..)",
                            file, a->sandbox_workspace);
    }
    return CF_OK;
}

/* optional_mapping returns the mapping under key (NULL when absent) or fails when it is not a
 * mapping. */
static enum cf_status optional_mapping(yaml_document_t *doc, yaml_node_t *root, const char *key,
                                       const char *file, yaml_node_t **out, struct cf_error *err)
{
    *out = map_get(doc, root, key);
    if (*out && (*out)->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID, "%s: %s: expected a mapping", file, key);
    }
    return CF_OK;
}

/* parse_limits reads the compaction and durability settings, with their defaults. */
static enum cf_status parse_limits(yaml_document_t *doc, yaml_node_t *root, const char *file,
                                   struct agent_def *a, struct cf_error *err)
{
    yaml_node_t *c, *d;
    enum cf_status rc;
    if ((rc = optional_mapping(doc, root, "compaction", file, &c, err)) != CF_OK) {
        return rc;
    }
    if (c &&
        ((rc = integer(map_get(doc, c, "reserve_tokens"), file, "compaction.reserve_tokens", 1,
                       1000000, &a->reserve_tokens, err)) != CF_OK ||
         (rc = integer(map_get(doc, c, "keep_recent_tokens"), file, "compaction.keep_recent_tokens",
                       1, 1000000, &a->keep_recent_tokens, err)) != CF_OK)) {
        return rc;
    }
    if ((rc = optional_mapping(doc, root, "durability", file, &d, err)) != CF_OK) {
        return rc;
    }
    int64_t attempts = 0;
    if (d && ((rc = integer(map_get(doc, d, "max_attempts"), file, "durability.max_attempts", 1,
                            1000, &attempts, err)) != CF_OK ||
              (rc = integer(map_get(doc, d, "timeout_ms"), file, "durability.timeout_ms", 1000,
                            30LL * 86400000, &a->timeout_ms, err)) != CF_OK ||
              (rc = integer(map_get(doc, d, "max_turns"), file, "durability.max_turns", 1,
                            AGENT_MAX_TURNS_LIMIT, &a->max_turns, err)) != CF_OK)) {
        return rc;
    }
    a->max_attempts = (int32_t)attempts;
    if (!a->max_turns) {
        a->max_turns = AGENT_MAX_TURNS_DEFAULT;
    }
    return CF_OK;
}

/* is_replica: addr is one of the replicas spec names (a dns: spec names none here). */
static bool is_replica(const char *spec, const char *addr)
{
    const char *names[PLACEMENT_REPLICAS_MAX];
    size_t n =
        strncmp(spec, "dns:", 4) ? placement_replicas(spec, names, PLACEMENT_REPLICAS_MAX) : 0;
    for (size_t i = 0; i < n && i < PLACEMENT_REPLICAS_MAX; i++) {
        if (!strcmp(names[i], addr)) {
            return true;
        }
    }
    return false;
}

/* check_tool_servers: at most AGENT_TOOL_SERVERS_MAX addresses, each named once and none the
 * sandbox's own toold (its tools are there already). */
static enum cf_status check_tool_servers(const char *file, const struct agent_def *a,
                                         struct cf_error *err)
{
    if (a->n_tool_servers > AGENT_TOOL_SERVERS_MAX) {
        return cf_error_set(err, CF_INVALID, "%s: tools: %zu tool servers; at most %d", file,
                            a->n_tool_servers, AGENT_TOOL_SERVERS_MAX);
    }
    for (size_t i = 0; i < a->n_tool_servers; i++) {
        const char *addr = a->tool_servers[i];
        if (strlen(addr) > AGENT_ADDRESS_MAX) {
            return cf_error_set(err, CF_INVALID, "%s: tools[%zu]: longer than %d characters", file,
                                i, AGENT_ADDRESS_MAX);
        }
        if (a->sandbox_tools && is_replica(a->sandbox_tools, addr)) {
            return cf_error_set(err, CF_INVALID,
                                "%s: tools[%zu]: %s is the sandbox's toold; its tools are the "
                                "agent's already",
                                file, i, addr);
        }
        for (size_t k = 0; k < i; k++) {
            if (!strcmp(addr, a->tool_servers[k])) {
                return cf_error_set(err, CF_INVALID, "%s: tools[%zu]: %s is listed twice", file, i,
                                    addr);
            }
        }
    }
    return CF_OK;
}

/* expand_env copies v with each ${VAR} replaced by the environment's value: false (why in
 * err) when a variable is not set or the result holds a line break. */
static bool expand_env(const char *v, const char *file, const char *field, char **out,
                       struct cf_error *err)
{
    struct buf b;
    bool fits = true;
    buf_init(&b, 8192);
    for (const char *p = v; *p && fits;) {
        const char *end = p[0] == '$' && p[1] == '{' ? strchr(p, '}') : NULL;
        if (!end) {
            fits = buf_append(&b, p++, 1) == CF_OK;
            continue;
        }
        char name[128];
        snprintf(name, sizeof(name), "%.*s", (int)(end - p - 2), p + 2);
        const char *val = end - p - 2 < (long)sizeof(name) ? getenv(name) : NULL;
        if (!val) {
            buf_cleanup(&b);
            cf_error_set(err, CF_INVALID, "%s: %s: environment variable %.*s is not set", file,
                         field, (int)(end - p - 2 > 200 ? 200 : end - p - 2), p + 2);
            return false;
        }
        fits = buf_append_str(&b, val) == CF_OK;
        p = end + 1;
    }
    if (!fits) {
        buf_cleanup(&b);
        cf_error_set(err, CF_INVALID, "%s: %s: longer than 8 KiB", file, field);
        return false;
    }
    if (b.len && (memchr(b.data, '\n', b.len) || memchr(b.data, '\r', b.len))) {
        buf_cleanup(&b);
        cf_error_set(err, CF_INVALID, "%s: %s: a header value may not hold a line break", file,
                     field);
        return false;
    }
    *out = buf_take(&b);
    return true;
}

static bool mcp_name_ok(const char *n)
{
    size_t len = strlen(n);
    return len >= 1 && len <= AGENT_MCP_NAME_MAX &&
           strspn(n, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") == len &&
           !strstr(n, "__");
}

/* parse_mcp_headers reads one server's headers: {Name: value} with ${VAR} expanded. */
static enum cf_status parse_mcp_headers(yaml_document_t *doc, yaml_node_t *h, const char *file,
                                        const char *at, struct agent_mcp *m, struct cf_error *err)
{
    if (!h) {
        return CF_OK;
    }
    size_t n = h->type == YAML_MAPPING_NODE
                   ? (size_t)(h->data.mapping.pairs.top - h->data.mapping.pairs.start)
                   : 0;
    if (h->type != YAML_MAPPING_NODE || n > AGENT_MCP_HEADERS_MAX) {
        return cf_error_set(err, CF_INVALID,
                            "%s: %s.headers: expected a mapping of at most %d "
                            "header names to values",
                            file, at, AGENT_MCP_HEADERS_MAX);
    }
    m->headers = mem_alloc(sizeof(char *) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        yaml_node_pair_t *p = &h->data.mapping.pairs.start[i];
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        yaml_node_t *v = yaml_document_get_node(doc, p->value);
        const char *name = k && k->type == YAML_SCALAR_NODE ? (char *)k->data.scalar.value : "";
        char field[160], *value;
        snprintf(field, sizeof(field), "%s.headers.%.64s", at, name);
        size_t len = strlen(name);
        if (!len || len > 64 ||
            strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                         "0123456789-_") != len) {
            return cf_error_set(err, CF_INVALID, "%s: %s: not a header name", file, field);
        }
        if (!v || v->type != YAML_SCALAR_NODE) {
            return cf_error_set(err, CF_INVALID, "%s: %s: expected a string", file, field);
        }
        if (!expand_env((char *)v->data.scalar.value, file, field, &value, err)) {
            return err->code;
        }
        m->headers[m->n_headers++] = mem_asprintf("%s: %s", name, value);
        free(value);
    }
    return CF_OK;
}

/* parse_mcp reads the optional mcp: {NAME: {url: URL, headers: {...}}, ...}. */
static enum cf_status parse_mcp(yaml_document_t *doc, yaml_node_t *root, const char *file,
                                struct agent_def *a, struct cf_error *err)
{
    yaml_node_t *mcp = map_get(doc, root, "mcp");
    if (!mcp) {
        return CF_OK;
    }
    size_t n = mcp->type == YAML_MAPPING_NODE
                   ? (size_t)(mcp->data.mapping.pairs.top - mcp->data.mapping.pairs.start)
                   : 0;
    if (mcp->type != YAML_MAPPING_NODE || n > AGENT_MCP_MAX) {
        return cf_error_set(err, CF_INVALID,
                            "%s: mcp: expected a mapping of at most %d server names to {url, "
                            "headers}",
                            file, AGENT_MCP_MAX);
    }
    a->mcp = mem_alloc(sizeof(*a->mcp) * (n + 1));
    memset(a->mcp, 0, sizeof(*a->mcp) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        yaml_node_pair_t *p = &mcp->data.mapping.pairs.start[i];
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        yaml_node_t *v = yaml_document_get_node(doc, p->value);
        struct agent_mcp *m = &a->mcp[a->n_mcp++];
        m->name = mem_strdup(k && k->type == YAML_SCALAR_NODE ? (char *)k->data.scalar.value : "");
        char at[64];
        snprintf(at, sizeof(at), "mcp.%.40s", m->name);
        if (!mcp_name_ok(m->name)) {
            return cf_error_set(err, CF_INVALID,
                                "%s: %s: a server name is 1 to %d of A-Z a-z 0-9 _ - (no "
                                "\"__\")",
                                file, at, AGENT_MCP_NAME_MAX);
        }
        for (size_t j = 0; j < i; j++) {
            if (!strcmp(a->mcp[j].name, m->name)) {
                return cf_error_set(err, CF_INVALID, "%s: %s: named twice", file, at);
            }
        }
        m->source = mem_asprintf("mcp:%s", m->name);
        enum cf_status rc;
        if (!v || v->type != YAML_MAPPING_NODE) {
            return cf_error_set(err, CF_INVALID, "%s: %s: expected {url: URL, headers: {...}}",
                                file, at);
        }
        for (yaml_node_pair_t *q = v->data.mapping.pairs.start; q < v->data.mapping.pairs.top;
             q++) {
            yaml_node_t *key = yaml_document_get_node(doc, q->key);
            const char *kn =
                key && key->type == YAML_SCALAR_NODE ? (char *)key->data.scalar.value : "";
            if (strcmp(kn, "url") && strcmp(kn, "headers")) {
                return cf_error_set(err, CF_INVALID,
                                    "%s: %s: unknown field '%.40s' (known: url, headers)", file, at,
                                    kn);
            }
        }
        if ((rc = scalar(map_get(doc, v, "url"), file, at, &m->url, err)) != CF_OK ||
            (rc = parse_mcp_headers(doc, map_get(doc, v, "headers"), file, at, m, err)) != CF_OK) {
            return rc;
        }
        if (!m->url || (strncmp(m->url, "http://", 7) && strncmp(m->url, "https://", 8)) ||
            strlen(m->url) > AGENT_URL_MAX || strpbrk(m->url, " \r\n")) {
            return cf_error_set(err, CF_INVALID,
                                "%s: %s.url: required, an http:// or https:// URL of at most %d "
                                "characters",
                                file, at, AGENT_URL_MAX);
        }
    }
    return CF_OK;
}

/* parse_fields reads every frontmatter field of a loaded document into a. */
static enum cf_status parse_fields(yaml_document_t *doc, const char *name_hint, const char *file,
                                   struct agent_def *a, struct cf_error *err)
{
    enum cf_status rc;
    yaml_node_t *root = yaml_document_get_root_node(doc);
    if (!root || root->type != YAML_MAPPING_NODE) {
        return cf_error_set(err, CF_INVALID, "%s: the frontmatter must be a mapping of fields",
                            file);
    }
    if ((rc = check_known_fields(doc, root, file, "", known_keys,
                                 sizeof(known_keys) / sizeof(*known_keys), err)) != CF_OK ||
        (rc = parse_identity(doc, root, name_hint, file, a, err)) != CF_OK ||
        (rc = parse_sandbox(doc, root, file, a, err)) != CF_OK ||
        (rc = string_list(doc, map_get(doc, root, "agents"), file, "agents", &a->subagents,
                          &a->n_subagents, err)) != CF_OK ||
        (rc = string_list(doc, map_get(doc, root, "skills"), file, "skills", &a->skills,
                          &a->n_skills, err)) != CF_OK ||
        (rc = string_list(doc, map_get(doc, root, "tools"), file, "tools", &a->tool_servers,
                          &a->n_tool_servers, err)) != CF_OK ||
        (rc = check_tool_servers(file, a, err)) != CF_OK ||
        (rc = parse_mcp(doc, root, file, a, err)) != CF_OK) {
        return rc;
    }
    return parse_limits(doc, root, file, a, err);
}

enum cf_status agents_parse(const char *text, const char *name_hint, const char *file,
                            struct agent_def *a, struct cf_error *err)
{
    yaml_document_t doc;
    const char *fm = NULL, *body = NULL, *problem;
    size_t fm_len = 0, line;
    enum cf_status rc;
    memset(a, 0, sizeof(*a));
    if ((rc = split_frontmatter(text, file, &fm, &fm_len, &body, err)) != CF_OK) {
        return rc;
    }
    if (yaml_load(fm, fm_len, &doc, &problem, &line) != CF_OK) {
        return cf_error_set(err, CF_INVALID, "%s: frontmatter line %zu: %s", file, line + 2,
                            problem);
    }
    rc = parse_fields(&doc, name_hint, file, a, err);
    if (rc == CF_OK) {
        a->instructions = mem_strdup(body);
    }
    yaml_document_delete(&doc);
    if (rc != CF_OK) {
        agents_free_one(a);
    }
    return rc;
}

static int cmp_agent(const void *x, const void *y)
{
    return strcmp(((const struct agent_def *)x)->name, ((const struct agent_def *)y)->name);
}

enum cf_status agents_load(const char *dir, struct agent_set *out, struct cf_error *err)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    enum cf_status rc = CF_OK;
    size_t cap = 8;
    out->items = mem_alloc(sizeof(*out->items) * cap);
    out->n = 0;
    if (!d) {
        return cf_error_set(err, CF_IO, "cannot read the agents directory %s: %s", dir,
                            strerror(errno));
    }
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 4 || strcmp(e->d_name + len - 3, ".md") != 0 || e->d_name[0] == '.') {
            continue;
        }
        char path[4096], stem[256];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        snprintf(stem, sizeof(stem), "%.*s", (int)(len - 3), e->d_name);
        char *text;
        size_t n;
        if ((rc = file_read_regular(path, AGENT_FILE_MAX, 0, &text, &n, err)) != CF_OK) {
            break; /* a FIFO or a device named NAME.md is refused, never waited on */
        }
        if (out->n == cap) {
            cap *= 2;
            out->items = mem_realloc(out->items, sizeof(*out->items) * cap);
        }
        rc = agents_parse(text, stem, path, &out->items[out->n], err);
        free(text);
        if (rc != CF_OK) {
            break;
        }
        out->n++;
    }
    closedir(d);
    if (rc == CF_OK && out->n == 0) {
        rc = cf_error_set(err, CF_INVALID, "%s holds no agent definitions (NAME.md files)", dir);
    }
    for (size_t i = 0; rc == CF_OK && i < out->n; i++) {
        for (size_t k = 0; k < out->items[i].n_subagents; k++) {
            if (!agents_find(out, out->items[i].subagents[k])) {
                rc = cf_error_set(err, CF_INVALID, "%s/%s.md: agents: unknown agent '%s'", dir,
                                  out->items[i].name, out->items[i].subagents[k]);
            }
        }
    }
    if (rc != CF_OK) {
        agents_free(out);
        return rc;
    }
    qsort(out->items, out->n, sizeof(*out->items), cmp_agent);
    return CF_OK;
}

const struct agent_def *agents_find(const struct agent_set *set, const char *name)
{
    for (size_t i = 0; i < set->n; i++) {
        if (!strcmp(set->items[i].name, name)) {
            return &set->items[i];
        }
    }
    return NULL;
}

static void free_list(char **items, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(items[i]);
    }
    free(items);
}

void agents_free_one(struct agent_def *a)
{
    free(a->name);
    free(a->description);
    free(a->model);
    free(a->provider);
    free(a->model_id);
    free(a->instructions);
    free(a->sandbox_tools);
    free(a->sandbox_workspace);
    free_list(a->subagents, a->n_subagents);
    free_list(a->skills, a->n_skills);
    free_list(a->tool_servers, a->n_tool_servers);
    for (size_t i = 0; i < a->n_mcp; i++) {
        free(a->mcp[i].name);
        free(a->mcp[i].url);
        free(a->mcp[i].source);
        free_list(a->mcp[i].headers, a->mcp[i].n_headers);
    }
    free(a->mcp);
    memset(a, 0, sizeof(*a));
}

void agents_free(struct agent_set *set)
{
    for (size_t i = 0; i < set->n; i++) {
        agents_free_one(&set->items[i]);
    }
    free(set->items);
    set->items = NULL;
    set->n = 0;
}

enum cf_status agents_page(const struct agent_set *set, int32_t page_size, const char *page_token,
                           size_t *first, size_t *count, char next_token[PAGE_TOKEN_MAX],
                           struct cf_error *err)
{
    char after[PAGE_TOKEN_POSITION_MAX + 1];
    size_t start = 0;
    enum cf_status rc;
    next_token[0] = '\0';
    if (page_size < 0) {
        return cf_error_set(err, CF_INVALID, "page_size must not be negative (got %d)",
                            (int)page_size);
    }
    size_t want = page_size == 0                     ? AGENTS_PAGE_SIZE_DEFAULT
                  : page_size > AGENTS_PAGE_SIZE_MAX ? AGENTS_PAGE_SIZE_MAX
                                                     : (size_t)page_size;
    if (page_token && *page_token) {
        if ((rc = page_token_parse(page_token, AGENTS_PAGE_SCOPE, after, err)) != CF_OK) {
            return rc;
        }
        /* the first agent named after the last one already returned (names are sorted) */
        while (start < set->n && strcmp(set->items[start].name, after) <= 0) {
            start++;
        }
    }
    size_t n = set->n - start < want ? set->n - start : want;
    *first = start;
    *count = n;
    if (start + n < set->n) {
        page_token_make(next_token, AGENTS_PAGE_SCOPE, set->items[start + n - 1].name);
    }
    return CF_OK;
}
