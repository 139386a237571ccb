/* placement.h - which toold replica holds a sandbox: rendezvous hashing over the replicas an
 * agent's sandbox.tools names.
 *
 * sandbox.tools names them one of three ways (the spec, as agents.c keeps it):
 *   "HOST:PORT"                one toold: every sandbox is there (no hashing)
 *   "A:PORT,B:PORT,..."        a list (the YAML list form, joined with commas): the replicas
 *                              by their addresses
 *   "dns:NAME:PORT"            the replicas behind a DNS name (a Kubernetes headless Service):
 *                              NAME's addresses, looked up at load and then every
 *                              PLACEMENT_REFRESH_MS, each replica named by the reverse lookup of
 *                              its address (a StatefulSet pod's stable name, e.g.
 *                              toold-0.toold.ns.svc.cluster.local) or, without one, by the
 *                              address itself; a named replica is dialled by its name
 *                              (resolved anew on each connect, so a pod that comes back at a
 *                              new address keeps its sandboxes, and a child handed the name
 *                              reaches it too), an unnamed one at its address; a reverse
 *                              lookup that fails once keeps the name the address had
 * A sandbox is placed on the replica whose hash of (replica name, sandbox name) is highest, so
 * every agentd that sees the same replicas places it alike, a replica added takes over only its
 * share of the sandboxes (about 1/n), and one that goes away gives away only its own. A lookup
 * that fails, or finds nothing, keeps the replicas known before. A replica that a lookup no
 * longer finds stays for the linger time (placement_set_linger_ms) from the first lookup that
 * missed it (a lookup that fails or finds nothing starts that time again): a toold pod out of
 * DNS for a moment in a rolling restart keeps its sandboxes, whose work waits for it
 * (drive.c), rather than having them placed where their workspaces are not.
 */
#ifndef CFLUE_AGENTD_PLACEMENT_H
#define CFLUE_AGENTD_PLACEMENT_H

#include "status.h"

#include <stdbool.h>
#include <stddef.h>

#define PLACEMENT_REPLICAS_MAX 64          /* replicas of one spec (more are left out, logged) */
#define PLACEMENT_REFRESH_MS 5000          /* between two lookups of a dns: spec */
#define PLACEMENT_ADDRESS_MAX 255          /* characters of one replica's address */
#define PLACEMENT_FIRST_LOOKUP_MS 10000    /* a pick waits this long for a new spec's lookup */
#define PLACEMENT_LINGER_DEFAULT_MS 300000 /* a replica missing from DNS stays this long */

/* placement_check validates a spec (as agents.c builds it); CF_INVALID with why filled. */
CF_MUST_CHECK enum cf_status placement_check(const char *spec, char *why, size_t n);

/* placement_watch has a dns: spec looked up by a thread of its own, at once and again every
 * PLACEMENT_REFRESH_MS (it never blocks on DNS: a resolver that does not answer must not hold
 * up agentd's start); a pick or a listing of the spec before its first lookup has ended waits
 * for it, at most PLACEMENT_FIRST_LOOKUP_MS. Other specs need nothing. */
void placement_watch(const char *spec);

/* placement_pick returns the address of the replica of spec that holds sandbox: spec itself
 * for one toold, else a string that lives as long as the process. NULL when a dns: spec has no
 * replica known (never resolved). *missing (when not NULL) tells whether that replica is one
 * the lookups no longer find, kept for the linger: its calls fail until it is back in DNS or
 * given up (then another replica holds the sandbox). */
const char *placement_pick(const char *spec, const char *sandbox, bool *missing);

/* placement_replicas writes up to max of spec's replicas known now into out (their addresses,
 * as placement_pick returns them) and returns how many there are. */
size_t placement_replicas(const char *spec, const char **out, size_t max);

/* placement_set_linger_ms sets how long a replica a lookup no longer finds stays placed on
 * (0: it goes at once). */
void placement_set_linger_ms(int64_t ms);

/* placement_stop ends the lookups and frees what placement holds (at exit). */
void placement_stop(void);

#endif
