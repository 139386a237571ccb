/* Unit tests of agentd/placement.c: which replica holds a sandbox. One toold takes everything;
 * a list spreads sandboxes evenly and places each the same way every time; a replica added
 * takes about its share and nothing moves between the others; one removed gives away only its
 * own; specs are checked; a dns: name is looked up through the system's resolver. */
#include "../check.h"

#include "placement.h"

#include <stdio.h>
#include <string.h>

#define SANDBOXES 3000

static const char *const four[] = {"t0:7102", "t1:7102", "t2:7102", "t3:7102"};

/* place fills out[i] with the index in four[] of the replica spec gives sandbox i. */
static void place(const char *spec, int out[SANDBOXES])
{
    for (int i = 0; i < SANDBOXES; i++) {
        char sb[32];
        snprintf(sb, sizeof(sb), "conv_%05d", i);
        const char *addr = placement_pick(spec, sb, NULL);
        out[i] = -1;
        for (int k = 0; addr && k < 4; k++) {
            if (!strcmp(addr, four[k])) {
                out[i] = k;
            }
        }
    }
}

static void test_spread_and_moves(void)
{
    static int three[SANDBOXES], again[SANDBOXES], plus[SANDBOXES], minus[SANDBOXES];
    place("t0:7102,t1:7102,t2:7102", three);
    place("t2:7102,t0:7102,t1:7102", again); /* the order of the list does not matter */
    int count[4] = {0};
    for (int i = 0; i < SANDBOXES; i++) {
        CHECK(three[i] >= 0 && three[i] < 3);
        CHECK(again[i] == three[i]);
        count[three[i]]++;
    }
    for (int k = 0; k < 3; k++) { /* each about a third (1000 of 3000) */
        CHECK(count[k] > 850 && count[k] < 1150);
    }
    /* a fourth replica: only sandboxes that go to it move, about a quarter */
    place("t0:7102,t1:7102,t2:7102,t3:7102", plus);
    int moved = 0;
    for (int i = 0; i < SANDBOXES; i++) {
        CHECK(plus[i] == three[i] || plus[i] == 3);
        moved += plus[i] != three[i];
    }
    CHECK(moved > 600 && moved < 900);
    /* t1 removed: only its sandboxes move */
    place("t0:7102,t2:7102", minus);
    for (int i = 0; i < SANDBOXES; i++) {
        CHECK(three[i] == 1 ? minus[i] != 1 : minus[i] == three[i]);
    }
    /* one toold: the spec itself, for every sandbox */
    bool missing = true;
    CHECK_STR(placement_pick("127.0.0.1:7102", "anything", &missing), "127.0.0.1:7102");
    CHECK(!missing); /* one toold is never out of DNS */
    const char *out[4];
    CHECK(placement_replicas("a:1,b:2", out, 4) == 2);
    CHECK_STR(out[1], "b:2");
}

static void refused(const char *spec, const char *want)
{
    char why[300] = "";
    CHECK(placement_check(spec, why, sizeof(why)) == CF_INVALID);
    CHECK(strstr(why, want) != NULL);
    if (!strstr(why, want)) {
        fprintf(stderr, "  %s: got '%s', wanted '%s'\n", spec, why, want);
    }
}

static void test_check(void)
{
    char why[300];
    CHECK(placement_check("127.0.0.1:7102", why, sizeof(why)) == CF_OK);
    CHECK(placement_check("unix:/run/toold.sock", why, sizeof(why)) == CF_OK);
    CHECK(placement_check("a:1,b:1", why, sizeof(why)) == CF_OK);
    CHECK(placement_check("dns:toold.cflue.svc.cluster.local:7102", why, sizeof(why)) == CF_OK);
    refused("a:1,a:1", "replica 1: a:1 is listed twice");
    refused("a:1,,b:1", "replica 1: '' is not an address");
    refused("a:1,b c:1", "replica 1: 'b c:1' is not an address");
    refused("a:1,dns:x:1", "replica 1: 'dns:x:1' is not an address");
    refused("dns:toold", "is not dns:NAME:PORT");
    refused("dns:toold:0", "is not dns:NAME:PORT");
    refused("dns::7102", "is not dns:NAME:PORT");
    refused("dns:toold:70000", "is not dns:NAME:PORT");
    char many[1024] = "";
    for (int i = 0; i <= PLACEMENT_REPLICAS_MAX; i++) {
        snprintf(many + strlen(many), sizeof(many) - strlen(many), "%sh%d:1", i ? "," : "", i);
    }
    refused(many, "more than 64 replicas");
}

static void test_dns(void)
{
    /* localhost's addresses (127.0.0.1, and ::1 where configured) all have the reverse name
     * localhost: one replica, named so and dialled by that name */
    placement_watch("dns:localhost:7102");
    const char *out[4];
    size_t n = placement_replicas("dns:localhost:7102", out, 4);
    CHECK(n == 1);
    bool missing = true;
    const char *picked = placement_pick("dns:localhost:7102", "sb", &missing);
    CHECK(!missing); /* found by the lookup that just ended */
    CHECK(picked != NULL && !strcmp(picked, "localhost:7102"));
    /* a name that does not resolve: no replica (agentd then faults the drive, saying so) */
    placement_watch("dns:no-such-host.invalid:7102");
    CHECK(placement_pick("dns:no-such-host.invalid:7102", "sb", NULL) == NULL);
    CHECK(placement_replicas("dns:no-such-host.invalid:7102", out, 4) == 0);
    /* never watched: nothing known */
    CHECK(placement_pick("dns:other:7102", "sb", NULL) == NULL);
}

int main(void)
{
    test_spread_and_moves();
    test_check();
    test_dns();
    placement_stop();
    return check_done("test_placement");
}
