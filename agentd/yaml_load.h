/* yaml_load.h - one YAML document loaded with libyaml, bounded in the time it may take.
 *
 * libyaml's scanner spends time quadratic in how deep flow collections ([ ] and { }) nest: a
 * frontmatter of 240 KB of "[" took a minute, 1 MiB many. Agent definitions come from an
 * operator's directory and a sandbox's skills from the model's own files: either could stall a
 * reload or a drive. So text whose brackets open deeper than YAML_FLOW_DEPTH_MAX is refused
 * before libyaml sees it (counted over the whole text, quoted scalars included: a legitimate
 * frontmatter never comes near).
 */
#ifndef CFLUE_AGENTD_YAML_LOAD_H
#define CFLUE_AGENTD_YAML_LOAD_H

#include "status.h"

#include <stddef.h>
#include <yaml.h>

#define YAML_FLOW_DEPTH_MAX 64

/* yaml_load loads text[0..len) as one document into *doc (the caller yaml_document_delete()s
 * it on CF_OK). CF_INVALID when the brackets nest too deep, libyaml refuses the text, or a
 * mapping has one key twice (YAML wants them unique; a reader would take either):
 * *problem then says why (static text) and *line is the 0-based line it points at. */
CF_MUST_CHECK enum cf_status yaml_load(const char *text, size_t len, yaml_document_t *doc,
                                       const char **problem, size_t *line);

#endif
