/* store_backup.h - cflue store backup FILE (Store.Backup), see store_backup.c. */
#ifndef CFLUE_CLI_STORE_BACKUP_H
#define CFLUE_CLI_STORE_BACKUP_H

#include "rpc.h"

/* store_backup_run writes a consistent copy of the database of the storaged at ch to file (a
 * new file: an existing one is refused with 2). 0 once file is whole and durable; 1 (printed
 * why, no file left) when the call, the stream or the disk failed. */
int store_backup_run(struct rpc_channel *ch, const char *file);

#endif
