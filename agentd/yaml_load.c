/* yaml_load.c - one YAML document loaded with libyaml, bounded (see yaml_load.h). */
#include "yaml_load.h"

#include "mem.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define STR_(x) #x
#define STR(x) STR_(x)

/* too_deep tells whether text opens more than YAML_FLOW_DEPTH_MAX brackets at once; *line is
 * where it does. */
static bool too_deep(const char *text, size_t len, size_t *line)
{
    int depth = 0;
    *line = 0;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (c == '\n') {
            ++*line;
        } else if (c == '[' || c == '{') {
            if (++depth > YAML_FLOW_DEPTH_MAX) {
                return true;
            }
        } else if ((c == ']' || c == '}') && depth > 0) {
            depth--;
        }
    }
    return false;
}

/* cmp_key orders scalar nodes by their bytes (a key that is no scalar sorts first). */
static int cmp_key(const void *a, const void *b)
{
    const yaml_node_t *x = *(const yaml_node_t *const *)a, *y = *(const yaml_node_t *const *)b;
    bool xs = x->type == YAML_SCALAR_NODE, ys = y->type == YAML_SCALAR_NODE;
    if (!xs || !ys) {
        return (int)xs - (int)ys;
    }
    size_t n = x->data.scalar.length < y->data.scalar.length ? x->data.scalar.length
                                                             : y->data.scalar.length;
    int c = memcmp(x->data.scalar.value, y->data.scalar.value, n);
    if (c) {
        return c;
    }
    return x->data.scalar.length < y->data.scalar.length   ? -1
           : x->data.scalar.length > y->data.scalar.length ? 1
                                                           : 0;
}

/* repeated_key tells whether a mapping of doc has one scalar key twice (YAML wants keys unique;
 * libyaml keeps both, and readers would take one or the other): *line is the later one's.
 * Sorted, not compared pairwise: a model's skill file may hold a mapping of 100,000 keys. */
static bool repeated_key(yaml_document_t *doc, size_t *line)
{
    for (yaml_node_t *n = doc->nodes.start; n < doc->nodes.top; n++) {
        if (n->type != YAML_MAPPING_NODE) {
            continue;
        }
        size_t count = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
        yaml_node_t **keys = mem_alloc(sizeof(*keys) * count);
        size_t k = 0;
        for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top;
             p++) {
            yaml_node_t *key = yaml_document_get_node(doc, p->key);
            if (key && key->type == YAML_SCALAR_NODE) {
                keys[k++] = key;
            }
        }
        qsort(keys, k, sizeof(*keys), cmp_key);
        bool twice = false;
        for (size_t i = 1; i < k && !twice; i++) {
            if (!cmp_key(&keys[i - 1], &keys[i])) {
                twice = true;
                *line = keys[i]->start_mark.line > keys[i - 1]->start_mark.line
                            ? keys[i]->start_mark.line
                            : keys[i - 1]->start_mark.line;
            }
        }
        free(keys);
        if (twice) {
            return true;
        }
    }
    return false;
}

enum cf_status yaml_load(const char *text, size_t len, yaml_document_t *doc, const char **problem,
                         size_t *line)
{
    yaml_parser_t parser;
    if (too_deep(text, len, line)) {
        *problem = "brackets ([ ] or { }) nest more than " STR(YAML_FLOW_DEPTH_MAX) " deep";
        return CF_INVALID;
    }
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    bool ok = yaml_parser_load(&parser, doc);
    if (!ok) {
        *problem = parser.problem ? parser.problem : "not valid YAML";
        *line = parser.problem_mark.line;
    }
    yaml_parser_delete(&parser);
    if (ok && repeated_key(doc, line)) {
        *problem = "a key appears twice in one mapping";
        yaml_document_delete(doc);
        return CF_INVALID;
    }
    return ok ? CF_OK : CF_INVALID;
}
