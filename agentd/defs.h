/* defs.h - the agent definitions in force, and reloading them without a restart.
 *
 * The definitions of --agents (agents.h) and the skills they declare (skills.h) are loaded
 * together into one snapshot. A reload (SIGHUP, or a change seen by the watch of the
 * directory) loads a new snapshot and puts it in force when it is valid, whole: a directory
 * that does not load, or a tool name clash (tool_servers_check), leaves the snapshot in force
 * as it was, and the log says why. Snapshots are shared by reference: each drive and each RPC
 * holds the one that was in force when it began, for its whole life, so nothing a reload
 * frees is in use.
 */
#ifndef CFLUE_AGENTD_DEFS_H
#define CFLUE_AGENTD_DEFS_H

#include "agents.h"
#include "skills.h"
#include "status.h"

#include <stdbool.h>
#include <stdint.h>

struct agent_defs {
    struct agent_set agents;
    struct skill_set skills; /* the declared skills of every agent */
    uint64_t generation;     /* 1 for the first snapshot, +1 for each one put in force */
    int refs;                /* under the module's lock */
};

/* defs_start loads dir and puts it in force (before any other defs_ call). CF_INVALID or
 * CF_IO, with why, when it does not load; tool clashes are checked by the caller. */
CF_MUST_CHECK enum cf_status defs_start(const char *dir, struct cf_error *err);
/* defs_get returns the snapshot in force, held until defs_put. Thread-safe. */
struct agent_defs *defs_get(void);
/* defs_generation: the generation of the snapshot in force (0 before defs_start). */
uint64_t defs_generation(void);
/* defs_put releases a snapshot defs_get returned (NULL is fine); the last holder frees it. */
void defs_put(struct agent_defs *defs);
/* defs_reload loads the directory again and puts it in force when it is valid and its tool
 * names do not clash (logged either way). true when a new snapshot is in force. Thread-safe:
 * reloads run one at a time. */
bool defs_reload(const char *why);
/* defs_changed: the directory's files (the *.md definitions and skills/<name>/ files, followed
 * through symbolic links, as a ConfigMap mounts them) differ from what the snapshot in force
 * was loaded from. */
bool defs_changed(void);
/* defs_stop releases the snapshot in force (at shutdown, after every drive ended). */
void defs_stop(void);

#endif
