/* tls_flags.h - the cflue command's TLS flags: --ca, --cert, --cert-key.
 *
 * Like --deadline-ms they may stand anywhere on the command line, and each has its variable:
 * --ca FILE (CFLUE_CA), the CA that verifies the daemons' certificates (given: every channel is
 * TLS); --cert FILE and --cert-key FILE (CFLUE_CERT, CFLUE_CERT_KEY), the client certificate
 * presented to a daemon that requires one (mTLS). The key's flag is not --key, which
 * `cflue store admit` takes for an idempotency key.
 */
#ifndef CFLUE_CLI_TLS_FLAGS_H
#define CFLUE_CLI_TLS_FLAGS_H

/* tls_flags_take removes --ca, --cert and --cert-key with their values from argv, falls back
 * to their variables, and when any is set reads and checks the files (tls_client_load), so
 * every channel made afterwards is TLS. Returns 0, or 2 after printing why (a flag without a
 * value, a file that cannot be read or does not check out, --cert without --ca). */
int tls_flags_take(int *argc, char **argv);

#endif
