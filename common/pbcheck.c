/* pbcheck.c - wire-level checks of string fields. */
#include "pbcheck.h"

#include "utf8.h"

#include <string.h>

#define DEPTH_MAX 32

static bool varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return true;
        }
    }
    return false;
}

static enum cf_status check(const ProtobufCMessageDescriptor *desc, const uint8_t *p,
                            const uint8_t *end, int depth, struct cf_error *err)
{
    if (depth > DEPTH_MAX) {
        return CF_OK;
    }
    while (p < end) {
        uint64_t key, n;
        if (!varint(&p, end, &key)) {
            return CF_OK; /* the decoder reports framing errors */
        }
        unsigned wire = (unsigned)(key & 7);
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(desc, (unsigned)(key >> 3));
        switch (wire) {
        case 0:
            if (!varint(&p, end, &n)) {
                return CF_OK;
            }
            break;
        case 1:
            p += 8;
            break;
        case 5:
            p += 4;
            break;
        case 2:
            if (!varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                return CF_OK;
            }
            if (f && f->type == PROTOBUF_C_TYPE_STRING) {
                size_t bad;
                if (memchr(p, 0, n)) {
                    return cf_error_set(err, CF_INVALID, "%s contains a NUL byte", f->name);
                }
                if (!utf8_valid((const char *)p, n, &bad)) {
                    return cf_error_set(err, CF_INVALID, "%s is not valid UTF-8 (byte %zu)",
                                        f->name, bad);
                }
            } else if (f && f->type == PROTOBUF_C_TYPE_MESSAGE) {
                enum cf_status rc = check(f->descriptor, p, p + n, depth + 1, err);
                if (rc != CF_OK) {
                    return rc;
                }
            }
            p += n;
            break;
        default:
            return CF_OK;
        }
    }
    return CF_OK;
}

enum cf_status pbcheck_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                               size_t len, struct cf_error *err)
{
    return check(desc, data, data + len, 0, err);
}
