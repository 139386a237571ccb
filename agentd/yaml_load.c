/* yaml_load.c - one YAML document loaded with libyaml, bounded (see yaml_load.h). */
#include "yaml_load.h"

#include <stdbool.h>

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
    return ok ? CF_OK : CF_INVALID;
}
