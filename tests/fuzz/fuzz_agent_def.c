/* Fuzz target: agent definition files (YAML frontmatter). */
#include "agents.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    struct agent_def a;
    struct cf_error err;
    memcpy(text, data, size);
    text[size] = '\0';
    if (agents_parse(text, "fuzz", "fuzz.md", &a, &err) == CF_OK) {
        agents_free_one(&a);
    }
    free(text);
    return 0;
}
