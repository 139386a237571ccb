/* metrics_http.h - the /metrics endpoint (Prometheus text format) over libmicrohttpd.
 *
 * One listener per daemon (--metrics-listen HOST:PORT; off by default), its own thread, plain
 * HTTP: GET /metrics answers metrics_render(); any other path 404, any other method 405. It
 * serves metrics only, so it needs no authentication; keep it on a pod-internal address. */
#ifndef CFLUE_METRICS_HTTP_H
#define CFLUE_METRICS_HTTP_H

#include "status.h"

struct metrics_http;

/* metrics_http_start listens on addr ("127.0.0.1:9464", "[::1]:9464"; ":9464", "[::]:9464"
 * and "0.0.0.0:9464" all take every address, IPv6 and IPv4 on one socket, IPv4 alone where
 * the host has no IPv6; port 0 picks one: *port tells it). The first call loads
 * libmicrohttpd. CF_INVALID for an address it cannot read, CF_UNAVAILABLE when the library
 * cannot be loaded, CF_IO when it cannot listen, with err naming why. */
CF_MUST_CHECK enum cf_status metrics_http_start(const char *addr, struct metrics_http **out,
                                                int *port, struct cf_error *err);

/* metrics_http_stop closes the listener and frees it (NULL is fine). */
void metrics_http_stop(struct metrics_http *h);

#endif
