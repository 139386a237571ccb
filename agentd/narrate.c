/* narrate.c - telling the model what changed in its agent's resources since it was last told.
 *
 * The system prompt is frozen: composed once, again only after a compaction. When the agent's
 * definition is reloaded with other instructions, when its sandbox is attached, detached or
 * switched, or when the tools, skills or subagents it is offered change (a tool server that
 * appeared or vanished, tools it changed, skills found in the sandbox), the model learns it
 * from signals (user-role records), written before the drive's first turn, never from a
 * rewritten prompt. Each system prompt carries the ResourceState it was composed from, and
 * each such signal the state it announced; the newest of them is the baseline the next drive
 * compares with. A conversation whose prompt carries no state (written by an older agentd) has
 * no baseline and is told nothing.
 */
#include "drive.h"
#include "ids.h"
#include "mem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INSTRUCTIONS_TOLD_MAX 32768 /* bytes of new instructions put in a signal */
#define DESCRIPTION_TOLD_MAX 200    /* bytes of a description in a signal's list */
#define SIGNAL_TEXT_MAX (1 << 20)   /* bytes of one signal: room for every list at its limits */
#define RESOURCES_MAX 1024          /* of each kind in a state (storaged's limit) */
#define RESOURCE_NAME_MAX 256       /* bytes of a name in a state (storaged's limit) */

/* ---------- the state now ---------- */

/* digest writes the FNV-1a of a, a separator and b as 16 hex digits (the separator tells
 * ("ab", "") from ("a", "b")). */
static void digest(char out[17], const char *a, const char *b)
{
    uint64_t h = ids_hash64_more(IDS_HASH64_INIT, a ? a : "", a ? strlen(a) : 0);
    h = ids_hash64_more(h, "\xff", 1);
    h = ids_hash64_more(h, b ? b : "", b ? strlen(b) : 0);
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* add appends one resource to list `which` of n (0 tools, 1 skills, 2 subagents). */
static void add(struct narrated *n, int which, const char *name, const char *a, const char *b)
{
    size_t same = 0;
    for (size_t i = 0; i < n->n; i++) {
        same += n->items[i].which == which;
    }
    if (same >= RESOURCES_MAX || !*name || strlen(name) > RESOURCE_NAME_MAX) {
        return; /* past what a state may hold: not tracked (nor told) */
    }
    n->items = mem_realloc(n->items, sizeof(*n->items) * (n->n + 1));
    struct narrated_item *it = &n->items[n->n++];
    cflue__v1__resource__init(&it->r);
    it->which = which;
    it->r.name = (char *)name;
    digest(it->digest, a, b);
}

const char *narrate_skill_description(const struct drive *d, const char *name)
{
    const struct skill *s = d->defs ? skills_find(&d->defs->skills, name) : NULL;
    s = s ? s : skills_find(&d->ws_skills, name);
    return s ? s->description : "";
}

/* subagent_description: what the roster says of subagent `name`. */
static const char *subagent_description(const struct drive *d, const char *name)
{
    const struct agent_def *a = d->defs ? agents_find(&d->defs->agents, name) : NULL;
    return a && a->description ? a->description : "";
}

void narrate_state(const struct drive *d, struct narrated *n)
{
    memset(n, 0, sizeof(*n));
    cflue__v1__resource_state__init(&n->st);
    const struct agent_def *a = d->agent;
    digest(n->instructions, a->instructions, "");
    n->st.instructions_digest = n->instructions;
    if (d->tools_addr) {
        snprintf(n->sandbox, sizeof(n->sandbox), "%s %s", d->tools_addr, d->workspace);
    }
    n->st.sandbox = n->sandbox;
    for (size_t i = 0; i < d->tools.n; i++) {
        add(n, 0, d->tools.tools[i].name, d->tools.tools[i].description,
            d->tools.tools[i].schema_json);
    }
    for (size_t i = 0; i < a->n_skills; i++) {
        add(n, 1, a->skills[i], narrate_skill_description(d, a->skills[i]), "");
    }
    for (size_t i = 0; i < d->ws_skills.n; i++) {
        add(n, 1, d->ws_skills.items[i].name, d->ws_skills.items[i].description, "");
    }
    for (size_t i = 0; i < a->n_subagents; i++) {
        add(n, 2, a->subagents[i], subagent_description(d, a->subagents[i]), "");
    }
    /* the pointer lists, once the items no longer move */
    n->ptrs = mem_alloc(sizeof(*n->ptrs) * (n->n + 1));
    Cflue__V1__Resource ***lists[3] = {&n->st.tools, &n->st.skills, &n->st.subagents};
    size_t *counts[3] = {&n->st.n_tools, &n->st.n_skills, &n->st.n_subagents};
    size_t at = 0;
    for (int w = 0; w < 3; w++) {
        *lists[w] = &n->ptrs[at];
        for (size_t i = 0; i < n->n; i++) {
            if (n->items[i].which == w) {
                n->items[i].r.digest = n->items[i].digest;
                n->ptrs[at++] = &n->items[i].r;
                (*counts[w])++;
            }
        }
    }
}

void narrate_cleanup(struct narrated *n)
{
    free(n->items);
    free(n->ptrs);
    memset(n, 0, sizeof(*n));
}

/* ---------- what changed ---------- */

/* baseline: the newest state the conversation told the model of, or NULL. */
static const Cflue__V1__ResourceState *baseline(const struct drive *d)
{
    for (size_t i = d->log.n; i-- > 0;) {
        const Cflue__V1__Record *r = d->log.recs[i];
        if (r->body_case == CFLUE__V1__RECORD__BODY_SYSTEM_PROMPT) {
            return r->system_prompt->state; /* NULL: an older prompt, no baseline */
        }
        if (r->body_case == CFLUE__V1__RECORD__BODY_SIGNAL && r->signal->state) {
            return r->signal->state;
        }
    }
    return NULL;
}

static const Cflue__V1__Resource *find(Cflue__V1__Resource *const *list, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(list[i]->name, name)) {
            return list[i];
        }
    }
    return NULL;
}

/* roster appends "All available <kind>s: a, b" for now's list. */
static void roster(struct buf *b, const char *kind, Cflue__V1__Resource *const *now, size_t n)
{
    buf_printf(b, "All available %ss: ", kind);
    for (size_t i = 0; i < n; i++) {
        buf_printf(b, "%s%s", i ? ", " : "", now[i]->name);
    }
    buf_append_str(b, n ? "" : "(none)");
}

/* describe_new appends "- **name** — description" for a new item of kind. */
static void describe_new(struct buf *b, const struct drive *d, int which, const char *name)
{
    const char *desc = "";
    int k = which == 0 ? toolset_find(&d->tools, name) : -1;
    if (k >= 0) {
        desc = d->tools.tools[k].description;
    } else if (which == 1) {
        desc = narrate_skill_description(d, name);
    } else if (which == 2) {
        desc = subagent_description(d, name);
    }
    size_t len = strcspn(desc, "\n");
    buf_printf(b, "\n- **%s**%s%.*s%s", name, *desc ? " — " : "",
               (int)(len > DESCRIPTION_TOLD_MAX ? DESCRIPTION_TOLD_MAX : len), desc,
               len > DESCRIPTION_TOLD_MAX ? "..." : "");
}

/* delta writes what changed between was and now (one kind) into b; false when nothing did. */
static bool delta(struct buf *b, const struct drive *d, int which, const char *kind,
                  Cflue__V1__Resource *const *was, size_t n_was, Cflue__V1__Resource *const *now,
                  size_t n_now)
{
    size_t added = 0;
    bool changed = false;
    for (size_t i = 0; i < n_now; i++) {
        added += !find(was, n_was, now[i]->name);
    }
    if (added) {
        buf_printf(b, "New %s%s available:", kind, added > 1 ? "s" : "");
        for (size_t i = 0; i < n_now; i++) {
            if (!find(was, n_was, now[i]->name)) {
                describe_new(b, d, which, now[i]->name);
            }
        }
        buf_append_str(b, "\n");
        changed = true;
    }
    for (size_t i = 0; i < n_was; i++) {
        const Cflue__V1__Resource *r = find(now, n_now, was[i]->name);
        if (!r) {
            buf_printf(b, "The %s \"%s\" is no longer available.\n", kind, was[i]->name);
            changed = true;
        } else if (strcmp(r->digest, was[i]->digest)) {
            buf_printf(b, "The %s \"%s\" was updated.\n", kind, was[i]->name);
            changed = true;
        }
    }
    if (changed) {
        roster(b, kind, now, n_now);
    }
    return changed;
}

/* tell records one signal of kind (about resource: "tool", "skill", "agent", or "") with text b
 * and the new state (id ...:<what>). The id names the definitions' generation too: two reloads
 * taken up at one turn boundary tell two signals (the same id would drop the second). */
static void tell(struct drive *d, const char *kind, const char *resource, const char *what,
                 struct buf *b, struct narrated *now)
{
    char id[256];
    snprintf(id, sizeof(id), "signal:%s:e%lld:t%d:g%llu:%s", d->sub->submission_id,
             (long long)d->fence.epoch, d->turn, (unsigned long long)d->defs->generation, what);
    struct buf clean;
    Cflue__V1__Signal sig = CFLUE__V1__SIGNAL__INIT;
    sig.kind = (char *)kind;
    sig.resource = (char *)resource;
    sig.text = (char *)dstore_utf8(buf_cstr(b), &clean); /* descriptions cut at a byte count */
    sig.state = &now->st;
    (void)dstore_defer_one(d, id, d->sub->submission_id, &sig.base);
    buf_cleanup(&clean);
    buf_reset(b);
}

/* tell_environment announces a sandbox attached, detached or switched, with every roster. */
static void tell_environment(struct drive *d, const Cflue__V1__ResourceState *was, struct buf *b,
                             struct narrated *now)
{
    const Cflue__V1__ResourceState *st = &now->st;
    if (d->tools_addr) {
        const char *cwd = d->tools.working_directory;
        buf_printf(b, "%s%s%s%s\n",
                   *was->sandbox ? "The sandbox you work in was replaced."
                                 : "You have a sandbox to work in now: file and shell tools.",
                   cwd && *cwd ? " The working directory is now " : "", cwd && *cwd ? cwd : "",
                   cwd && *cwd ? "." : "");
    } else {
        buf_append_str(b, "There is no sandbox any more: the file and shell tools are gone, and "
                          "so is the working directory.\n");
    }
    buf_append_str(b, "Files, directories and command results from the earlier environment may "
                      "not be there: check again before relying on anything learned about "
                      "it.\n\n");
    roster(b, "tool", st->tools, st->n_tools);
    buf_append_str(b, "\n");
    roster(b, "skill", st->skills, st->n_skills);
    buf_append_str(b, "\n");
    roster(b, "agent", st->subagents, st->n_subagents);
    tell(d, "environment", "", "environment", b, now);
}

void narrate_changes(struct drive *d)
{
    const Cflue__V1__ResourceState *was = baseline(d);
    if (!was) {
        return;
    }
    struct narrated now;
    struct buf b;
    narrate_state(d, &now);
    buf_init(&b, SIGNAL_TEXT_MAX);
    const Cflue__V1__ResourceState *st = &now.st;
    if (strcmp(was->instructions_digest, st->instructions_digest)) {
        const char *ins = d->agent->instructions ? d->agent->instructions : "";
        size_t len = strlen(ins);
        buf_printf(&b,
                   "Your instructions were changed. From now on, follow these instead of "
                   "the ones you were given before:\n\n%.*s%s",
                   (int)(len > INSTRUCTIONS_TOLD_MAX ? INSTRUCTIONS_TOLD_MAX : len), ins,
                   len > INSTRUCTIONS_TOLD_MAX ? "\n[... cut]" : "");
        tell(d, "instructions", "", "instructions", &b, &now);
    }
    if (strcmp(was->sandbox, st->sandbox)) {
        tell_environment(d, was, &b, &now); /* its rosters stand for every change below */
    } else {
        if (delta(&b, d, 0, "tool", was->tools, was->n_tools, st->tools, st->n_tools)) {
            tell(d, "resources", "tool", "tools", &b, &now);
        }
        if (delta(&b, d, 1, "skill", was->skills, was->n_skills, st->skills, st->n_skills)) {
            tell(d, "resources", "skill", "skills", &b, &now);
        }
        if (delta(&b, d, 2, "agent", was->subagents, was->n_subagents, st->subagents,
                  st->n_subagents)) {
            tell(d, "resources", "agent", "agents", &b, &now);
        }
    }
    buf_cleanup(&b);
    narrate_cleanup(&now);
}
