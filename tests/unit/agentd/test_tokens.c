/* Unit tests of agentd/tokens.c: the token file's rules (each refusal names the file and the
 * line), and authentication against a set in force: bearer parsing, hashes, agents, admin,
 * reload keeping the set in force when the new file is bad. */
#include "../check.h"

#include "tokens.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct cf_error err;

/* hex writes the SHA-256 of s as 64 hex digits into out. */
static void hex(const char *s, char out[65])
{
    unsigned char md[32];
    unsigned int n = 0;
    EVP_Digest(s, strlen(s), md, &n, EVP_sha256(), NULL);
    for (unsigned int i = 0; i < 32; i++) {
        snprintf(out + 2 * i, 3, "%02x", md[i]);
    }
}

/* refused: text does not parse, and the message holds want. */
static void refused(const char *text, const char *want)
{
    struct token_set *set = (struct token_set *)1;
    CHECK(tokens_parse(text, strlen(text), "t.yaml", &set, &err) == CF_INVALID);
    CHECK(set == NULL);
    if (!strstr(err.msg, want)) {
        fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, want);
        CHECK(0);
    }
}

static void test_parse(void)
{
    char a[65], b[65], text[1024];
    struct token_set *set;
    hex("secret-a", a);
    hex("secret-b", b);
    snprintf(text, sizeof(text),
             "tokens:\n"
             "  - name: alice@example.com\n"
             "    sha256: %s\n"
             "    agents: [coder, \"*\"]\n"
             "  - {name: root, sha256: \"%s\", admin: true}\n",
             a, b);
    CHECK(tokens_parse(text, strlen(text), "t.yaml", &set, &err) == CF_OK);
    CHECK(tokens_set_count(set) == 2);
    tokens_set_free(set);
    CHECK(tokens_parse("tokens: []\n", 11, "t.yaml", &set, &err) == CF_OK);
    CHECK(tokens_set_count(set) == 0);
    tokens_set_free(set);

    refused("", "t.yaml:0: expected a mapping");
    refused("tokens: {}\n", "t.yaml:1: tokens: expected a list");
    refused("tokens: []\nextra: 1\n", "t.yaml:2: extra: unknown key");
    refused("tokens:\n  - name: x\n", "t.yaml:2: tokens[0]: sha256 is required");
    refused("tokens:\n  - sha256: x\n", "t.yaml:2: tokens[0].sha256");
    snprintf(text, sizeof(text), "tokens:\n  - sha256: %s\n", a);
    refused(text, "t.yaml:2: tokens[0]: name is required");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    key: v\n", a);
    refused(text, "t.yaml:4: tokens[0]: key: unknown key");
    snprintf(text, sizeof(text), "tokens:\n  - name: x y\n    sha256: %s\n", a);
    refused(text, "t.yaml:2: tokens[0].name");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %.63sg\n", a);
    refused(text, "t.yaml:3: tokens[0].sha256: expected the SHA-256");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    admin: yes\n", a);
    refused(text, "t.yaml:4: tokens[0].admin: expected true or false");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    agents: coder\n", a);
    refused(text, "t.yaml:4: tokens[0].agents: expected a list");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    agents: [a/b]\n", a);
    refused(text, "tokens[0].agents[0]");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    agents: [*]\n", a);
    refused(text, "\"*\", in quotes");
    snprintf(text, sizeof(text),
             "tokens:\n  - name: x\n    sha256: %s\n  - name: x\n    sha256: %s\n", a, b);
    refused(text, "t.yaml:4: tokens[1].name: 'x' is the name of the entry at line 2");
    snprintf(text, sizeof(text),
             "tokens:\n  - name: x\n    sha256: %s\n  - name: y\n    sha256: %s\n", a, a);
    refused(text, "t.yaml:4: tokens[1].sha256: the same hash as the entry at line 2");
    refused("tokens: [\n", "t.yaml:");
    /* a key twice: libyaml keeps both; the second agents list was written past the first's
     * (agents[0] left NULL: the first Submit with that token crashed agentd) */
    snprintf(text, sizeof(text),
             "tokens:\n  - name: x\n    sha256: %s\n    agents: [plain]\n    agents: [plain]\n", a);
    refused(text, "t.yaml:5: a key appears twice in one mapping");
    snprintf(text, sizeof(text), "tokens:\n  - name: x\n    sha256: %s\n    name: y\n", a);
    refused(text, "t.yaml:4: a key appears twice");
    refused("tokens: []\ntokens: []\n", "t.yaml:2: a key appears twice");
}

/* authenticated: the authorization value authenticates as name (admin or not). */
static void authenticated(const char *authorization, const char *name, bool admin)
{
    struct principal p;
    CHECK(tokens_authenticate(authorization, &p, &err) == CF_OK);
    CHECK_STR(p.name, name);
    CHECK(p.admin == admin);
}

static void unauthenticated(const char *authorization)
{
    struct principal p;
    CHECK(tokens_authenticate(authorization, &p, &err) == CF_UNAUTHENTICATED);
    CHECK(!*p.name);
    CHECK(!strstr(err.msg, "secret-")); /* never a word of what was sent */
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_in_force(void)
{
    char a[65], b[65], text[1024], path[64];
    struct principal off;
    snprintf(path, sizeof(path), "/tmp/cflue-test-tokens-%d.yaml", (int)getpid());
    /* before tokens_start: off, every caller passes */
    CHECK(!tokens_enabled());
    CHECK(tokens_authenticate(NULL, &off, &err) == CF_OK && !*off.name);
    CHECK(tokens_allow_agent(&off, "anything") && tokens_owns(&off, "someone"));
    CHECK(tokens_start("", &err) == CF_OK && !tokens_enabled());

    hex("secret-a", a);
    hex("secret-b", b);
    snprintf(text, sizeof(text),
             "tokens:\n  - name: alice\n    sha256: %s\n    agents: [coder]\n"
             "  - name: root\n    sha256: %s\n    agents: [\"*\"]\n    admin: true\n",
             a, b);
    write_file(path, text);
    CHECK(tokens_start(path, &err) == CF_OK);
    CHECK(tokens_enabled() && tokens_count() == 2);
    CHECK(!tokens_changed());

    authenticated("Bearer secret-a", "alice", false);
    authenticated("bearer   secret-a", "alice", false);
    authenticated("Bearer secret-b", "root", true);
    unauthenticated(NULL);
    unauthenticated("");
    unauthenticated("Bearer secret-c");
    unauthenticated("Bearer secret-");
    unauthenticated("Bearer secret-a ");
    unauthenticated("Basic secret-a");
    unauthenticated("secret-a");
    unauthenticated("Bearer ");

    struct principal alice = {.name = "alice"}, root = {.name = "root", .admin = true};
    CHECK(tokens_allow_agent(&alice, "coder") && !tokens_allow_agent(&alice, "other"));
    CHECK(tokens_allow_agent(&root, "other"));
    CHECK(tokens_owns(&alice, "alice") && !tokens_owns(&alice, "bob"));
    CHECK(!tokens_owns(&alice, "")); /* made without authentication: admins only */
    CHECK(tokens_owns(&root, "bob") && tokens_owns(&root, ""));

    /* a bad file keeps the set in force; a good one replaces it */
    write_file(path, "tokens: nope\n");
    CHECK(tokens_changed());
    CHECK(!tokens_reload("test"));
    CHECK(!tokens_changed()); /* not tried again until it changes */
    authenticated("Bearer secret-a", "alice", false);
    snprintf(text, sizeof(text), "tokens:\n  - name: bob\n    sha256: %s\n", a);
    write_file(path, text);
    CHECK(tokens_reload("test"));
    authenticated("Bearer secret-a", "bob", false);
    unauthenticated("Bearer secret-b");
    CHECK(!tokens_allow_agent(&alice, "coder")); /* alice is no longer in force */
    struct principal bob = {.name = "bob"};
    CHECK(!tokens_allow_agent(&bob, "coder")); /* no agents: none */
    tokens_stop();
    CHECK(!tokens_enabled());
    unlink(path);
}

int main(void)
{
    test_parse();
    test_in_force();
    return check_done("test_tokens");
}
