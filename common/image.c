/* image.c - the images a model may be shown (image.h). */
#include "image.h"

#include <strings.h>

static const char *const TYPES[] = {"image/png", "image/jpeg", "image/gif", "image/webp"};

const char *image_type(const char *mime_type)
{
    for (size_t i = 0; mime_type && i < sizeof(TYPES) / sizeof(*TYPES); i++) {
        if (!strcasecmp(mime_type, TYPES[i])) {
            return TYPES[i];
        }
    }
    return NULL;
}

const char *image_refusal(const char *mime_type, size_t len, size_t n, size_t bytes)
{
    if (!image_type(mime_type)) {
        return "only PNG, JPEG, GIF and WebP images can be shown";
    }
    if (!len) {
        return "it holds no data";
    }
    if (len > IMAGE_BYTES_MAX) {
        return "it is larger than 5 MiB, the most an image may have";
    }
    if (n >= IMAGE_RESULT_MAX) {
        return "a tool result can show at most 8 images";
    }
    if (bytes + len > IMAGE_RESULT_BYTES_MAX) {
        return "the result's images would pass 6 MiB together";
    }
    return NULL;
}
