/* json_write.h - JSON text written straight into a buffer: the model requests' bodies.
 *
 * Each model call sends the whole context (tens of kilobytes of tool output is common), so the
 * body is written on every turn. jansson encodes a string one code point at a time (5-7 ns a
 * byte); this writer copies each run of bytes that needs no escape in one piece, about ten
 * times faster, and builds no tree first. It only writes: what arrives as JSON text (a call's
 * arguments, a tool's schema) is parsed by jansson and handed over as a json_t.
 *
 * Strings are written as valid JSON whatever they hold: quote, backslash and control
 * characters escaped, bytes that are not well-formed UTF-8 replaced by U+FFFD (as
 * utf8_sanitize does). The caller opens and closes containers in order; commas and colons
 * are the writer's business. Nesting is limited to JW_DEPTH_MAX levels (a request needs 6);
 * past it the writer only records the error, and jw_take reports it.
 */
#ifndef CFLUE_JSON_WRITE_H
#define CFLUE_JSON_WRITE_H

#include "buf.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#define JW_DEPTH_MAX 64

struct jw {
    struct buf out;
    uint64_t has_member; /* bit d: the container at depth d + 1 has a member already */
    uint64_t in_array;   /* bit d: the container at depth d + 1 is an array */
    int depth;           /* open containers */
    bool after_key;      /* a key was written: its value comes next, without a comma */
    bool failed;         /* too deep, too big, or a json_t that could not be written */
};

/* jw_init starts an empty text of at most max bytes. */
void jw_init(struct jw *w, size_t max);

/* jw_object / jw_array open a container; jw_end closes the innermost one. */
void jw_object(struct jw *w);
void jw_array(struct jw *w);
void jw_end(struct jw *w);

/* jw_key writes an object member's name; the member's value is written next. */
void jw_key(struct jw *w, const char *name);

/* jw_string writes s (NUL-terminated) as a JSON string; NULL is written as "". */
void jw_string(struct jw *w, const char *s);

/* jw_stringn writes s[0..n) as a JSON string. */
void jw_stringn(struct jw *w, const char *s, size_t n);

/* jw_key_string writes an object member whose value is string s (NULL: ""). */
void jw_key_string(struct jw *w, const char *name, const char *s);

/* jw_int, jw_bool and jw_null write those values. */
void jw_int(struct jw *w, long long v);
void jw_bool(struct jw *w, bool v);
void jw_null(struct jw *w);

/* jw_raw writes text as a value as it is: it must be one JSON value (jansson's own output,
 * say), which the writer does not check. */
void jw_raw(struct jw *w, const char *text);

/* jw_json writes v (any JSON value; it is not stolen) through jansson. */
void jw_json(struct jw *w, const json_t *v);

/* jw_take ends the text and hands it to the caller (free() it), with its length in *len_out
 * when len_out is not NULL. NULL when the writer failed, wrote nothing, or a container is
 * still open. The writer is released either way (jw_init starts it again). */
char *jw_take(struct jw *w, size_t *len_out);

/* jw_cleanup releases a writer whose text is not taken (jw_init starts it again). */
void jw_cleanup(struct jw *w);

#endif
