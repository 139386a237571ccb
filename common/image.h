/* image.h - the images a model may be shown: which types, how many and how large.
 *
 * One table for both daemons: storaged refuses a tool_result record whose images break these
 * bounds (INVALID_ARGUMENT naming the field), and agentd shows the model a note in place of
 * such an image, so what it records always passes. The bounds keep a tool result's record
 * under storaged's bound on one record (8 MiB less 1 KiB by default, docs/storaged.md), with
 * room for its text, and each image within what the providers take.
 */
#ifndef CFLUE_IMAGE_H
#define CFLUE_IMAGE_H

#include <stdbool.h>
#include <stddef.h>

#define IMAGE_BYTES_MAX (5 << 20)        /* one image */
#define IMAGE_RESULT_MAX 8               /* images of one tool result */
#define IMAGE_RESULT_BYTES_MAX (6 << 20) /* all images of one tool result together */
#define IMAGE_NAME_MAX 255               /* bytes of an image's name */

/* image_type: mime_type's entry in the table of types the providers show (image/png,
 * image/jpeg, image/gif, image/webp; compared ignoring case), a static lower-case string;
 * NULL for any other (or NULL). */
const char *image_type(const char *mime_type);

/* image_refusal: why a tool result holding n images of `bytes` bytes together may not take one
 * more of type mime_type and len bytes, in plain words for the model ("only PNG, JPEG, GIF and
 * WebP images can be shown"); NULL when it may. A static string. */
const char *image_refusal(const char *mime_type, size_t len, size_t n, size_t bytes);

#endif
