/* store_clock.c - storaged's clock: the monotonic clock plus an offset that only the writer
 * moves (store_clock.h). */
#include "store_clock.h"

#include "clock.h"

#include <stdatomic.h>

/* wall less monotonic, as last adopted; 0: not started (never so once started) */
static _Atomic int64_t offset_ms;

/* offset returns the offset, setting it to the wall clock's on first use. */
static int64_t offset(void)
{
    int64_t off = atomic_load_explicit(&offset_ms, memory_order_relaxed);
    if (off == 0) {
        int64_t start = clock_now_ms() - clock_mono_ms();
        atomic_compare_exchange_strong_explicit(&offset_ms, &off, start, memory_order_relaxed,
                                                memory_order_relaxed);
        off = atomic_load_explicit(&offset_ms, memory_order_relaxed);
    }
    return off;
}

int64_t store_clock_now(void)
{
    return clock_mono_ms() + offset();
}

void store_clock_read(struct store_clock_reading *r)
{
    int64_t off = offset();
    r->mono_ms = clock_mono_ms();
    r->wall_ms = clock_now_ms();
    r->step_ms = r->wall_ms - (r->mono_ms + off);
}

void store_clock_adopt(const struct store_clock_reading *r)
{
    atomic_store_explicit(&offset_ms, r->wall_ms - r->mono_ms, memory_order_relaxed);
}
