/* Fuzz target: what the model is shown of an MCP server's tools/call result (mcp_result_read:
 * its text and its images, base64 decoded): the result is whatever JSON the server sent. */
#include "mcp.h"

#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_t *result = json_loadb((const char *)data, size, 0, NULL);
    if (!result) {
        return 0;
    }
    struct mcp_result r;
    mcp_result_init(&r);
    mcp_result_read(&r, result);
    mcp_result_cleanup(&r);
    json_decref(result);
    return 0;
}
