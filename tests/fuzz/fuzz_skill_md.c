/* Fuzz target: SKILL.md files (frontmatter fenced by "---" lines, YAML, the skill rules). */
#include "skills.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    struct skill s;
    struct cf_error err;
    memcpy(text, data, size);
    text[size] = '\0'; /* the parser is given the length: NULs inside stay in play */
    if (skill_parse(text, size, "fuzz/SKILL.md", "review-pr", &s, &err) == CF_OK) {
        skill_free(&s);
    }
    free(text);
    return 0;
}
