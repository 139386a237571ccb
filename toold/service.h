/* service.h - cflue.v1.Tools and cflue.v1.Sandbox on toold. */
#ifndef CFLUE_TOOLD_SERVICE_H
#define CFLUE_TOOLD_SERVICE_H

#include "rpc.h"
#include "tool.h"
#include "workspace.h"

/* toold_register adds the Tools and Sandbox methods to srv, serving sandboxes from ws with
 * cfg. Both must outlive the server. */
void toold_register(struct rpc_server *srv, struct workspaces *ws, const struct toold_config *cfg);

#endif
