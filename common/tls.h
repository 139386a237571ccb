/* tls.h - TLS for cflue's listeners and channels: PEM files read, checked, and reloaded.
 *
 * Server: a tls_server holds a listener's certificate chain and private key and, for mTLS, the
 * CA its clients' certificates must chain to. gRPC asks it for its certificates through a
 * certificate-config fetcher at each new connection's handshake; tls_server_reload (SIGHUP)
 * reads the files again and, when they changed and check out, the next handshake serves the
 * new ones. A bad new file keeps the old certificates (logged); connections already open are
 * never touched.
 *
 * Client: tls_client_load makes every channel made afterwards (rpc_channel_new) TLS, verifying
 * the server's certificate against a CA and, when given, presenting a client certificate.
 *
 * Checks: every certificate file holds at least one PEM certificate; a key file holds one
 * unencrypted PEM private key that matches the first certificate of its chain. Files are read
 * whole, up to TLS_PEM_MAX bytes. Nothing here logs a key, nor any file's content: only
 * paths, serial numbers, subjects and expiry dates.
 */
#ifndef CFLUE_TLS_H
#define CFLUE_TLS_H

#include "status.h"

#include <grpc/grpc_security.h>
#include <stdbool.h>

#define TLS_PEM_MAX (1 << 20) /* the largest PEM file read */

/* Three PEM files and the flags that named them (for messages). Paths NULL or "" mean none;
 * they must stay valid for the process's life (they come from argv or the environment). */
struct tls_paths {
    const char *ca, *cert, *key;
    const char *ca_flag, *cert_flag, *key_flag; /* "--tls-client-ca", "--tls-cert", ... */
};

struct tls_server;

/* tls_server_new reads and checks p->cert and p->key (both required) and p->ca (the client CA:
 * when set, clients must present a certificate it signed; NULL or "": no client certificate is
 * asked). On success *out is the caller's (tls_server_free). On failure *out is NULL and err
 * names the flag, the file and what is wrong with it (CF_INVALID: unreadable, not PEM, key not
 * matching). Reads files only; needs no grpc_init. */
CF_MUST_CHECK enum cf_status tls_server_new(const struct tls_paths *p, struct tls_server **out,
                                            struct cf_error *err);

/* tls_server_credentials returns new server credentials (the caller releases them) that take
 * their certificates from t at every handshake; t must outlive every server they serve. Call
 * after grpc_init. */
grpc_server_credentials *tls_server_credentials(struct tls_server *t);

/* tls_server_mtls reports whether t requires client certificates. */
bool tls_server_mtls(const struct tls_server *t);

/* tls_server_describe writes "cert=PATH serial=HEX not_after=DATE" of the certificate t serves
 * now (for the start-up log line). */
void tls_server_describe(struct tls_server *t, char *out, size_t out_len);

/* tls_server_reload reads t's files again (SIGHUP). Changed and good: the next handshake
 * serves them (logged tls_reloaded with the new serial); unchanged: logged tls_unchanged; bad
 * (unreadable, not PEM, key not matching): t keeps what it had (logged tls_reload_failed with
 * the reason). Never fails otherwise; thread-safe with the handshakes. */
void tls_server_reload(struct tls_server *t);

/* tls_server_free releases t (NULL is fine) once no server uses its credentials any more. */
void tls_server_free(struct tls_server *t);

/* tls_client_load reads and checks p->ca (required: the CA that verifies the servers) and,
 * when given, p->cert and p->key (both or neither: the client certificate presented to the
 * servers). From then on rpc_channel_new makes TLS channels with them. CF_INVALID with a
 * message naming the flag and file on failure (nothing changes then). Reads files only; call
 * once, at start (the paths are kept for tls_client_reload). */
CF_MUST_CHECK enum cf_status tls_client_load(const struct tls_paths *p, struct cf_error *err);

/* tls_client_on reports whether tls_client_load succeeded. */
bool tls_client_on(void);

/* tls_client_has_cert reports whether channels present a client certificate. */
bool tls_client_has_cert(void);

/* tls_client_reload reads the files given to tls_client_load again (SIGHUP): channels made
 * afterwards use them when they changed and check out; channels already made keep theirs. A bad
 * file keeps the old ones (logged tls_reload_failed). Nothing when TLS is off. */
void tls_client_reload(void);

/* tls_channel_credentials returns new channel credentials (the caller releases them): TLS with
 * what tls_client_load read, or plaintext (insecure) when it was not called. */
grpc_channel_credentials *tls_channel_credentials(void);

/* tls_client_clear forgets what tls_client_load read (channels are plaintext again).
 * Idempotent. */
void tls_client_clear(void);

#endif
