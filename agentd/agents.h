/* agents.h - agent definitions: NAME.md files with YAML frontmatter in --agents DIR.
 *
 *   ---
 *   name: coder                      # optional; must match the file name when given
 *   description: Fixes small bugs
 *   model: anthropic/claude-sonnet-4-5   # provider/model-id; provider anthropic or openai;
 *                                    # absent: a subagent that runs with its parent's model
 *   sandbox: {tools: "127.0.0.1:7102", workspace: example}   # absent: no sandbox tools
 *     # optional, under sandbox: limits each of its commands gets, tighter than toold's own
 *     # (a larger one leaves toold's): limits: {cpu_s, memory_mib, procs, file_mib, disk_mib}
 *   agents: [helper]                 # subagents it may delegate to
 *   skills: [review]                 # declared skills: DIR/skills/<name>/SKILL.md (skills.h)
 *   tools: ["127.0.0.1:7200"]        # extra cflue.v1.Tools servers
 *   mcp:                             # MCP servers (streamable HTTP), tools mcp__<name>__<tool>
 *     docs: {url: "https://mcp.example.com/mcp", headers: {Authorization: "Bearer ${TOKEN}"}}
 *   compaction: {reserve_tokens: 20000, keep_recent_tokens: 8000}
 *   durability: {max_attempts: 10, timeout_ms: 3600000, max_turns: 200}
 *   ---
 *   Markdown body: the agent's instructions.
 *
 * Every problem is reported with the file and the field, so a bad definition is found at
 * start-up rather than at the first submission.
 */
#ifndef CFLUE_AGENTD_AGENTS_H
#define CFLUE_AGENTD_AGENTS_H

#define AGENT_MAX_TURNS_DEFAULT 200
#define AGENT_MAX_TURNS_LIMIT 10000
#define AGENT_MODEL_MAX 256      /* characters of provider/model-id (storaged's delegation.model) */
#define AGENT_MCP_MAX 8          /* mcp: servers of an agent */
#define AGENT_MCP_NAME_MAX 32    /* characters of an MCP server's name */
#define AGENT_MCP_HEADERS_MAX 16 /* headers of an MCP server */
#define AGENT_URL_MAX 2048       /* characters of an MCP server's URL */
#define AGENT_TOOL_SERVERS_MAX 8 /* tools: addresses of an agent */
#define AGENT_ADDRESS_MAX 255    /* characters of a tool server's address */

#include "page_token.h"
#include "status.h"

#include <stddef.h>
#include <stdint.h>

/* An MCP server an agent uses (mcp: in its definition; mcp.c). */
struct agent_mcp {
    char *name;     /* [A-Za-z0-9_-]{1,32}: its tools are mcp__<name>__<tool> */
    char *url;      /* the streamable HTTP endpoint, http:// or https:// */
    char *source;   /* "mcp:<name>": the source of its tools in a drive's tool set */
    char **headers; /* "Name: value" lines sent with every request (${VAR} expanded) */
    size_t n_headers;
};

/* sandbox.limits: bounds on each command of the agent's sandbox (0: toold's own). */
struct agent_limits {
    int64_t cpu_s;
    int64_t memory_mib;
    int64_t procs;
    int64_t file_mib;
    int64_t disk_mib;
};

struct agent_def {
    char *name;
    char *description;
    char *model;    /* "anthropic/..." or "openai/..."; NULL: its parent's (a subagent only) */
    char *provider; /* "anthropic" or "openai" (NULL when model is) */
    char *model_id; /* (NULL when model is) */
    char *instructions;
    char *sandbox_tools;     /* toold address, NULL without a sandbox */
    char *sandbox_workspace; /* sandbox name; "{conversation}" is replaced by the id */
    struct agent_limits sandbox_limits;
    char **subagents;
    size_t n_subagents;
    char **skills;
    size_t n_skills;
    char **tool_servers; /* its own cflue.v1.Tools servers (tool_servers.c), in order */
    size_t n_tool_servers;
    struct agent_mcp *mcp; /* its MCP servers, in order */
    size_t n_mcp;
    int64_t reserve_tokens;     /* 0: default */
    int64_t keep_recent_tokens; /* 0: default */
    int32_t max_attempts;       /* 0: storaged's default */
    int64_t timeout_ms;         /* 0: storaged's default */
    int64_t max_turns;          /* model turns one submission may take (then: failed) */
};

struct agent_set {
    struct agent_def *items;
    size_t n;
};

/* agents_model_check: model is provider/model-id of a provider agentd speaks (anthropic,
 * openai), at most AGENT_MODEL_MAX characters. CF_OK with the provider's length in
 * *provider_len; CF_INVALID with why otherwise. */
CF_MUST_CHECK enum cf_status agents_model_check(const char *model, size_t *provider_len,
                                                struct cf_error *err);

/* agents_load reads every *.md file of dir. CF_INVALID with "FILE: field: problem" for the
 * first bad definition; CF_IO when dir cannot be read. An empty directory is CF_INVALID. */
CF_MUST_CHECK enum cf_status agents_load(const char *dir, struct agent_set *out,
                                         struct cf_error *err);

/* agents_parse parses one definition from text (name_hint is the file's stem, file is used in
 * messages). On success fills *out (free with agents_free_one). */
CF_MUST_CHECK enum cf_status agents_parse(const char *text, const char *name_hint, const char *file,
                                          struct agent_def *out, struct cf_error *err);

/* agents_find returns the agent named name, or NULL. */
const struct agent_def *agents_find(const struct agent_set *set, const char *name);

/* The page token scope of ListAgents; a token's position is the last name of its page. */
#define AGENTS_PAGE_SCOPE "agents"
#define AGENTS_PAGE_SIZE_DEFAULT 100
#define AGENTS_PAGE_SIZE_MAX 1000

/* agents_page picks one page of set (sorted by name) for ListAgents: page_size agents (0: 100;
 * above 1000: 1000) after the name page_token carries ("" or NULL: from the first). On CF_OK,
 * *first and *count name the page's agents in set->items, and next_token holds the token of
 * the next page ("" when this page is the last). CF_INVALID for a negative page_size, or
 * (reason INVALID_PAGE_TOKEN) a token that is malformed or not ListAgents'. */
CF_MUST_CHECK enum cf_status agents_page(const struct agent_set *set, int32_t page_size,
                                         const char *page_token, size_t *first, size_t *count,
                                         char next_token[PAGE_TOKEN_MAX], struct cf_error *err);

/* agents_free_one / agents_free release definitions. */
void agents_free_one(struct agent_def *a);
void agents_free(struct agent_set *set);

#endif
