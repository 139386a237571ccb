/* tls.c - PEM files for servers and channels: read, checked with OpenSSL, handed to gRPC.
 *
 * Reload: SIGHUP reads the files in the signal-waiting thread (tls_server_reload), so a bad
 * file is reported the moment the operator acts, and no handshake ever waits on a disk. A good
 * new set replaces the current one under the server's lock and bumps its generation; gRPC's
 * fetcher (fetch_config), called at every handshake, returns the set as a new config once per
 * generation (GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW) and UNCHANGED otherwise, which costs one
 * lock. gRPC keeps the previous config when it cannot use a new one, and so do we when the
 * files do not check out: the listener never stops serving.
 *
 * Each tls_server serves one listener: the fetcher's first call (when gRPC creates the
 * listener's security connector) hands the initial set.
 */
#include "tls.h"

#include "file_read.h"
#include "log.h"
#include "mem.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One set of PEM texts (NUL-terminated; NULL: not given) and what the log says of it. */
struct pem_set {
    char *cert, *key, *ca;
    size_t cert_len, key_len, ca_len;
    char serial[80];    /* of the first certificate of cert, hex */
    char not_after[32]; /* its expiry, UTC, ISO 8601 */
    char subject[256];
};

struct tls_server {
    struct tls_paths paths;
    pthread_mutex_t mu;
    struct pem_set cur;  /* under mu */
    uint64_t generation; /* under mu: bumped by each reload that changed the set */
    uint64_t handed;     /* under mu: the generation the fetcher last gave gRPC */
};

static bool given(const char *path)
{
    return path && *path;
}

/* read_pem reads path whole (at most TLS_PEM_MAX bytes) into a new NUL-terminated buffer. A
 * FIFO or a device there is refused without waiting; key material is wiped wherever it was. */
static enum cf_status read_pem(const char *flag, const char *path, char **out, size_t *out_len,
                               struct cf_error *err)
{
    struct cf_error why;
    enum cf_status rc = file_read_regular(path, TLS_PEM_MAX, FILE_READ_SECRET, out, out_len, &why);
    if (rc != CF_OK) {
        return cf_error_set(err, CF_INVALID, "%s: %s", flag, why.msg);
    }
    return CF_OK;
}

/* first_cert parses the PEM certificates of text: the first one (the caller frees it), or NULL
 * when there is none. Every block must parse. */
static X509 *first_cert(const char *text, size_t len)
{
    BIO *b = BIO_new_mem_buf(text, (int)len);
    if (!b) {
        return NULL;
    }
    X509 *first = PEM_read_bio_X509(b, NULL, NULL, NULL);
    for (X509 *x = first; x;) {
        x = PEM_read_bio_X509(b, NULL, NULL, NULL);
        X509_free(x);
    }
    BIO_free(b);
    ERR_clear_error(); /* the end of the file reads as an error */
    return first;
}

/* no_password refuses encrypted keys instead of prompting on a terminal. */
static int no_password(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return -1;
}

static EVP_PKEY *read_key(const char *text, size_t len)
{
    BIO *b = BIO_new_mem_buf(text, (int)len);
    if (!b) {
        return NULL;
    }
    EVP_PKEY *k = PEM_read_bio_PrivateKey(b, NULL, no_password, NULL);
    BIO_free(b);
    ERR_clear_error();
    return k;
}

/* describe fills the serial, expiry and subject of x into set. */
static void describe(struct pem_set *set, X509 *x)
{
    snprintf(set->serial, sizeof(set->serial), "?");
    BIGNUM *bn = ASN1_INTEGER_to_BN(X509_get0_serialNumber(x), NULL);
    char *hex = bn ? BN_bn2hex(bn) : NULL;
    if (hex) {
        snprintf(set->serial, sizeof(set->serial), "%s", hex);
    }
    OPENSSL_free(hex);
    BN_free(bn);
    struct tm tm;
    snprintf(set->not_after, sizeof(set->not_after), "?");
    if (ASN1_TIME_to_tm(X509_get0_notAfter(x), &tm) == 1) {
        strftime(set->not_after, sizeof(set->not_after), "%Y-%m-%dT%H:%M:%SZ", &tm);
    }
    X509_NAME_oneline(X509_get_subject_name(x), set->subject, (int)sizeof(set->subject));
}

static void pem_set_cleanup(struct pem_set *set)
{
    if (set->key) {
        OPENSSL_cleanse(set->key, set->key_len); /* no key left in freed memory */
    }
    free(set->cert);
    free(set->key);
    free(set->ca);
    memset(set, 0, sizeof(*set));
}

static bool same_text(const char *a, size_t a_len, const char *b, size_t b_len)
{
    return (!a && !b) || (a && b && a_len == b_len && memcmp(a, b, a_len) == 0);
}

static bool same_set(const struct pem_set *a, const struct pem_set *b)
{
    return same_text(a->cert, a->cert_len, b->cert, b->cert_len) &&
           same_text(a->key, a->key_len, b->key, b->key_len) &&
           same_text(a->ca, a->ca_len, b->ca, b->ca_len);
}

/* load_set reads and checks the files of p into out: cert and key together (a chain whose
 * first certificate the key matches), ca alone (at least one certificate). On failure out is
 * left empty. */
static enum cf_status load_set(const struct tls_paths *p, struct pem_set *out, struct cf_error *err)
{
    enum cf_status rc = CF_OK;
    X509 *cert = NULL, *ca = NULL;
    EVP_PKEY *key = NULL;
    memset(out, 0, sizeof(*out));
    if (given(p->cert) != given(p->key)) {
        rc = cf_error_set(err, CF_INVALID, "%s and %s go together: give both or neither",
                          p->cert_flag, p->key_flag);
        goto done;
    }
    if (given(p->cert)) {
        if ((rc = read_pem(p->cert_flag, p->cert, &out->cert, &out->cert_len, err)) != CF_OK ||
            (rc = read_pem(p->key_flag, p->key, &out->key, &out->key_len, err)) != CF_OK) {
            goto done;
        }
        if (!(cert = first_cert(out->cert, out->cert_len))) {
            rc = cf_error_set(err, CF_INVALID, "%s: '%s' holds no PEM certificate", p->cert_flag,
                              p->cert);
            goto done;
        }
        if (!(key = read_key(out->key, out->key_len))) {
            rc = cf_error_set(err, CF_INVALID,
                              "%s: '%s' holds no PEM private key (an encrypted key cannot be "
                              "read: give it unencrypted, with file permissions guarding it)",
                              p->key_flag, p->key);
            goto done;
        }
        if (X509_check_private_key(cert, key) != 1) {
            ERR_clear_error();
            rc = cf_error_set(err, CF_INVALID,
                              "%s: the key in '%s' does not match the certificate in '%s' (%s)",
                              p->key_flag, p->key, p->cert, p->cert_flag);
            goto done;
        }
        describe(out, cert);
    }
    if (given(p->ca)) {
        if ((rc = read_pem(p->ca_flag, p->ca, &out->ca, &out->ca_len, err)) != CF_OK) {
            goto done;
        }
        if (!(ca = first_cert(out->ca, out->ca_len))) {
            rc = cf_error_set(err, CF_INVALID, "%s: '%s' holds no PEM certificate", p->ca_flag,
                              p->ca);
            goto done;
        }
    }
done:
    X509_free(cert);
    X509_free(ca);
    EVP_PKEY_free(key);
    if (rc != CF_OK) {
        pem_set_cleanup(out);
    }
    return rc;
}

/* warn_expired logs when the certificate of set has expired (it is still served: the peers
 * say so at their handshake, which names the problem better than a refusal to start). */
static void warn_expired(const char *path, const struct pem_set *set)
{
    X509 *x = set->cert ? first_cert(set->cert, set->cert_len) : NULL;
    if (x && X509_cmp_current_time(X509_get0_notAfter(x)) < 0) {
        log_warn("tls_cert_expired", "cert=%s serial=%s not_after=%s", path, set->serial,
                 set->not_after);
    }
    X509_free(x);
}

/* ---------- server ---------- */

enum cf_status tls_server_new(const struct tls_paths *p, struct tls_server **out,
                              struct cf_error *err)
{
    *out = NULL;
    if (!given(p->cert) || !given(p->key)) {
        return cf_error_set(err, CF_INVALID, "%s and %s go together: give both or neither",
                            p->cert_flag, p->key_flag);
    }
    struct pem_set set;
    enum cf_status rc = load_set(p, &set, err);
    if (rc != CF_OK) {
        return rc;
    }
    struct tls_server *t = mem_alloc(sizeof(*t));
    t->paths = *p;
    pthread_mutex_init(&t->mu, NULL);
    t->cur = set;
    t->generation = 1;
    warn_expired(p->cert, &t->cur);
    *out = t;
    return CF_OK;
}

/* fetch_config is gRPC's certificate-config fetcher, called at the listener's creation and at
 * every handshake (on gRPC's threads): the current set once per generation. */
static grpc_ssl_certificate_config_reload_status
fetch_config(void *arg, grpc_ssl_server_certificate_config **config)
{
    struct tls_server *t = arg;
    grpc_ssl_certificate_config_reload_status st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    pthread_mutex_lock(&t->mu);
    if (t->handed != t->generation) {
        grpc_ssl_pem_key_cert_pair pair = {t->cur.key, t->cur.cert};
        /* gRPC 1.51 asserts (and aborts) on a fetched config without root certificates, even
         * when no client certificate is asked for. Then the chain itself stands in: with
         * GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE no certificate request is sent, so it is
         * never used to verify anything. */
        const char *roots = t->cur.ca ? t->cur.ca : t->cur.cert;
        *config = grpc_ssl_server_certificate_config_create(roots, &pair, 1); /* copies */
        if (t->handed != 0) {
            log_info("tls_serving", "cert=%s serial=%s", t->paths.cert, t->cur.serial);
        }
        t->handed = t->generation;
        st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
    }
    pthread_mutex_unlock(&t->mu);
    return st;
}

grpc_server_credentials *tls_server_credentials(struct tls_server *t)
{
    grpc_ssl_client_certificate_request_type req =
        tls_server_mtls(t) ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                           : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
    grpc_ssl_server_credentials_options *o =
        grpc_ssl_server_credentials_create_options_using_config_fetcher(req, fetch_config, t);
    return grpc_ssl_server_credentials_create_with_options(o); /* takes o */
}

bool tls_server_mtls(const struct tls_server *t)
{
    return given(t->paths.ca);
}

void tls_server_describe(struct tls_server *t, char *out, size_t out_len)
{
    char q[320];
    pthread_mutex_lock(&t->mu);
    snprintf(out, out_len, "cert=%s serial=%s not_after=%s subject=%s", t->paths.cert,
             t->cur.serial, t->cur.not_after, log_quote(q, sizeof(q), t->cur.subject));
    pthread_mutex_unlock(&t->mu);
}

void tls_server_reload(struct tls_server *t)
{
    struct pem_set set;
    struct cf_error err;
    char q[CF_ERROR_MSG_MAX + 16];
    if (load_set(&t->paths, &set, &err) != CF_OK) {
        log_error("tls_reload_failed",
                  "cert=%s err=%s note=\"still serving the previous certificate\"", t->paths.cert,
                  log_quote(q, sizeof(q), err.msg));
        return;
    }
    warn_expired(t->paths.cert, &set);
    pthread_mutex_lock(&t->mu);
    bool changed = !same_set(&set, &t->cur);
    if (changed) {
        struct pem_set old = t->cur;
        t->cur = set;
        t->generation++;
        memset(&set, 0, sizeof(set));
        pem_set_cleanup(&old);
    }
    char serial[sizeof(t->cur.serial)], not_after[sizeof(t->cur.not_after)];
    snprintf(serial, sizeof(serial), "%s", t->cur.serial);
    snprintf(not_after, sizeof(not_after), "%s", t->cur.not_after);
    pthread_mutex_unlock(&t->mu);
    pem_set_cleanup(&set);
    if (changed) {
        log_info("tls_reloaded",
                 "cert=%s serial=%s not_after=%s note=\"new connections get it; open ones keep "
                 "theirs\"",
                 t->paths.cert, serial, not_after);
    } else {
        log_info("tls_unchanged", "cert=%s serial=%s", t->paths.cert, serial);
    }
}

void tls_server_free(struct tls_server *t)
{
    if (!t) {
        return;
    }
    pem_set_cleanup(&t->cur);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* ---------- client ---------- */

static struct {
    pthread_mutex_t mu;
    bool on;
    struct tls_paths paths;
    struct pem_set set; /* ca: the servers' CA; cert, key: ours, or NULL */
} g_client = {.mu = PTHREAD_MUTEX_INITIALIZER};

enum cf_status tls_client_load(const struct tls_paths *p, struct cf_error *err)
{
    if (!given(p->ca)) {
        return cf_error_set(err, CF_INVALID,
                            "%s is required with %s and %s (the CA that verifies the servers)",
                            p->ca_flag, p->cert_flag, p->key_flag);
    }
    struct pem_set set;
    enum cf_status rc = load_set(p, &set, err);
    if (rc != CF_OK) {
        return rc;
    }
    if (set.cert) {
        warn_expired(p->cert, &set);
    }
    pthread_mutex_lock(&g_client.mu);
    pem_set_cleanup(&g_client.set);
    g_client.set = set;
    g_client.paths = *p;
    g_client.on = true;
    pthread_mutex_unlock(&g_client.mu);
    return CF_OK;
}

bool tls_client_on(void)
{
    pthread_mutex_lock(&g_client.mu);
    bool on = g_client.on;
    pthread_mutex_unlock(&g_client.mu);
    return on;
}

bool tls_client_has_cert(void)
{
    pthread_mutex_lock(&g_client.mu);
    bool has = g_client.on && g_client.set.cert;
    pthread_mutex_unlock(&g_client.mu);
    return has;
}

void tls_client_reload(void)
{
    pthread_mutex_lock(&g_client.mu);
    struct tls_paths p = g_client.paths;
    bool on = g_client.on;
    pthread_mutex_unlock(&g_client.mu);
    if (!on) {
        return;
    }
    struct pem_set set;
    struct cf_error err;
    char q[CF_ERROR_MSG_MAX + 16];
    if (load_set(&p, &set, &err) != CF_OK) {
        log_error("tls_reload_failed",
                  "ca=%s err=%s note=\"new channels keep the previous certificates\"", p.ca,
                  log_quote(q, sizeof(q), err.msg));
        return;
    }
    pthread_mutex_lock(&g_client.mu);
    bool changed = !same_set(&set, &g_client.set);
    if (changed) {
        struct pem_set old = g_client.set;
        g_client.set = set;
        memset(&set, 0, sizeof(set));
        pem_set_cleanup(&old);
    }
    pthread_mutex_unlock(&g_client.mu);
    pem_set_cleanup(&set);
    if (changed) {
        log_info("tls_client_reloaded",
                 "ca=%s cert=%s note=\"channels opened from now on use them; open ones keep "
                 "theirs\"",
                 p.ca, given(p.cert) ? p.cert : "(none)");
    } else {
        log_info("tls_client_unchanged", "ca=%s", p.ca);
    }
}

grpc_channel_credentials *tls_channel_credentials(void)
{
    pthread_mutex_lock(&g_client.mu);
    grpc_channel_credentials *c;
    if (!g_client.on) {
        c = grpc_insecure_credentials_create();
    } else {
        grpc_ssl_pem_key_cert_pair pair = {g_client.set.key, g_client.set.cert};
        c = grpc_ssl_credentials_create(g_client.set.ca, g_client.set.cert ? &pair : NULL, NULL,
                                        NULL); /* copies the texts */
    }
    pthread_mutex_unlock(&g_client.mu);
    return c;
}

void tls_client_clear(void)
{
    pthread_mutex_lock(&g_client.mu);
    pem_set_cleanup(&g_client.set);
    g_client.on = false;
    pthread_mutex_unlock(&g_client.mu);
}
