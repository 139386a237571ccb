/* Fuzz target: tool-call arguments (model output) against every tool's schema. */
#include "tool.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    int n;
    memcpy(text, data, size);
    text[size] = '\0';
    const struct tool_def *defs = tool_all(&n);
    for (int i = 0; i < n; i++) {
        struct tool_result res;
        tool_result_init(&res);
        json_t *args = tool_parse_args(&defs[i], text, &res);
        json_decref(args);
        tool_result_cleanup(&res);
    }
    free(text);
    return 0;
}
