/* service.h - the cflue.v1.Store gRPC service: request validation, dispatch of writes to the
 * group-commit writer and of reads to reader connections, and the Follow stream. */
#ifndef CFLUE_STORAGED_SERVICE_H
#define CFLUE_STORAGED_SERVICE_H

#include "ledger.h"
#include "rpc.h"
#include "writer.h"

struct service;

/* service_new prepares the service over a running writer, opening reader connections to
 * db_path on demand. Never NULL. */
struct service *service_new(const char *db_path, struct writer *w, const struct ledger_config *cfg);

/* service_register adds every Store method to the server. */
void service_register(struct service *svc, struct rpc_server *srv);

/* service_release_memory drops the page caches of the idle reader connections and asks the
 * writer to drop its own (writer_release_memory): an idle storaged returns to its idle size
 * however large the database grew. For daemon_wait_for_stop; arg is the service. */
void service_release_memory(void *arg);

/* service_free closes the reader connections (after the server stopped). NULL is fine. */
void service_free(struct service *svc);

#endif
