/* token.c - the bearer token of the agent commands, and `cflue token` (token.h). */
#include "token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LINE_MAX_BYTES (TOKEN_SECRET_MAX + 2) /* the token, "\r\n" */
#define NEW_TOKEN_BYTES 32

/* valid: 1 to TOKEN_SECRET_MAX bytes of printable ASCII without spaces. */
static bool valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (s[i] <= ' ' || s[i] > '~') {
            return false;
        }
    }
    return n >= 1 && n <= TOKEN_SECRET_MAX;
}

/* read_line reads f's first line (without "\n" or "\r\n") into out (LINE_MAX_BYTES + 1
 * bytes); false when it is longer than that. */
static bool read_line(FILE *f, char *out, size_t *len)
{
    size_t n = fread(out, 1, LINE_MAX_BYTES + 1, f);
    char *nl = memchr(out, '\n', n);
    if (nl) {
        n = (size_t)(nl - out);
    } else if (n > LINE_MAX_BYTES) {
        return false;
    }
    if (n && out[n - 1] == '\r') {
        n--;
    }
    out[n] = '\0';
    *len = n;
    return true;
}

/* from_file reads the token of path into out. 0, or 2 after printing why. */
static int from_file(const char *path, const char *what, char *out, size_t *len)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cflue: %s %s: cannot read it\n", what, path);
        return 2;
    }
    bool ok = read_line(f, out, len);
    fclose(f);
    if (!ok) {
        fprintf(stderr, "cflue: %s %s: its first line is longer than a token may be (%d)\n", what,
                path, TOKEN_SECRET_MAX);
        return 2;
    }
    return 0;
}

int token_attach(struct rpc_channel *ch, const char *flag_token, const char *flag_file)
{
    char secret[LINE_MAX_BYTES + 1], header[LINE_MAX_BYTES + 16];
    size_t len = 0;
    const char *what = NULL;
    int rc = 0;
    if (flag_token && flag_file) {
        fprintf(stderr, "cflue: --token and --token-file: give one of them\n");
        return 2;
    }
    const char *env = getenv("CFLUE_TOKEN"), *env_file = getenv("CFLUE_TOKEN_FILE");
    if (flag_token || (!flag_file && env && *env)) {
        what = flag_token ? "--token" : "CFLUE_TOKEN";
        len = strlen(flag_token ? flag_token : env);
        if (len > TOKEN_SECRET_MAX) {
            fprintf(stderr, "cflue: the token of %s is longer than %d characters\n", what,
                    TOKEN_SECRET_MAX);
            return 2;
        }
        memcpy(secret, flag_token ? flag_token : env, len + 1);
    } else if (flag_file || (env_file && *env_file)) {
        what = flag_file ? "--token-file" : "CFLUE_TOKEN_FILE";
        rc = from_file(flag_file ? flag_file : env_file, what, secret, &len);
    } else {
        return 0; /* no token: agentd without --tokens needs none */
    }
    if (rc == 0 && !valid(secret, len)) {
        fprintf(stderr,
                "cflue: the token of %s must be 1 to %d printable characters without spaces\n",
                what, TOKEN_SECRET_MAX);
        rc = 2;
    }
    if (rc == 0) {
        snprintf(header, sizeof(header), "Bearer %s", secret);
        if (!rpc_channel_add_metadata(ch, "authorization", header)) {
            fprintf(stderr, "cflue: internal error: the channel takes no more metadata\n");
            rc = 2;
        }
    }
    OPENSSL_cleanse(secret, sizeof(secret));
    OPENSSL_cleanse(header, sizeof(header));
    return rc;
}

/* print_sha256 prints the SHA-256 of s in lower-case hex, as sha256sum does. */
static int print_sha256(const char *s, size_t n)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int md_len = 0;
    if (!EVP_Digest(s, n, md, &md_len, EVP_sha256(), NULL)) {
        fprintf(stderr, "cflue: cannot compute SHA-256 (libcrypto failed)\n");
        return 1;
    }
    for (unsigned int i = 0; i < md_len; i++) {
        printf("%02x", md[i]);
    }
    printf("\n");
    return 0;
}

int cmd_token(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[2], "hash")) {
        char secret[LINE_MAX_BYTES + 1];
        size_t len = 0;
        bool ok = read_line(stdin, secret, &len);
        int rc = 2;
        if (!ok || !valid(secret, len)) {
            fprintf(stderr,
                    "cflue: token hash: stdin must hold one token of 1 to %d printable "
                    "characters without spaces\n",
                    TOKEN_SECRET_MAX);
        } else {
            rc = print_sha256(secret, len);
        }
        OPENSSL_cleanse(secret, sizeof(secret));
        return rc;
    }
    if (argc == 3 && !strcmp(argv[2], "new")) {
        unsigned char raw[NEW_TOKEN_BYTES];
        char secret[NEW_TOKEN_BYTES * 2 + 1];
        if (RAND_bytes(raw, sizeof(raw)) != 1) {
            fprintf(stderr, "cflue: token new: no random bytes (libcrypto failed)\n");
            return 1;
        }
        for (size_t i = 0; i < sizeof(raw); i++) {
            snprintf(secret + 2 * i, 3, "%02x", raw[i]);
        }
        printf("token:  %s\nsha256: ", secret);
        int rc = print_sha256(secret, strlen(secret));
        OPENSSL_cleanse(raw, sizeof(raw));
        OPENSSL_cleanse(secret, sizeof(secret));
        return rc;
    }
    fprintf(stderr, "usage: cflue token hash    (the token on stdin; prints its sha256)\n"
                    "       cflue token new     (prints a new random token and its sha256)\n");
    return 2;
}
