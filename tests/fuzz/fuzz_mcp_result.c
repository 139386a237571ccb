/* Fuzz target: what the model reads of an MCP server's tools/call result (mcp_result_text):
 * the result is whatever JSON the server sent. */
#include "mcp.h"

#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_t *result = json_loadb((const char *)data, size, 0, NULL);
    if (!result) {
        return 0;
    }
    struct buf out;
    bool is_error;
    buf_init(&out, MCP_TEXT_MAX + 512);
    mcp_result_text(result, &out, &is_error);
    buf_cleanup(&out);
    json_decref(result);
    return 0;
}
