/* One team of worker threads for every kernel in the process: `pool_run(task, ctx, parts)` runs
 * task(ctx, part, parts) for every part, part 0 on the caller, each other on a worker of its own,
 * and returns when all are done.
 *
 * Why not OpenMP: a decoding step is a few hundred short parallel regions, a few hundred
 * microseconds apart. libgomp lets its workers spin only briefly when it manages more threads than
 * the CPUs (torch's team of the thread that loaded the model counts, idle or not), so each region
 * woke a sleeping worker, which costs 100-200 microseconds on a virtual machine: as much as the
 * region's work. Here a worker spins for SPIN_NS after each part (yielding its CPU to anything
 * else runnable) before it sleeps, so the regions of one forward find it awake.
 *
 * One job runs at a time (callers queue on `running`); a job is published by bumping `generation`
 * after its fields are written, and a worker reads them after it sees the new generation.
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_WORKERS 255
#define SPIN_NS 2000000 /* 2 ms: longer than the gaps between one forward's regions */

typedef void (*pool_task)(void *ctx, int64_t part, int64_t parts);

static pthread_mutex_t running = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t woken = PTHREAD_COND_INITIALIZER;
static int sleepers, workers;
static atomic_long generation;
static atomic_int pending;
static pool_task job_task;
static void *job_ctx;
static int64_t job_parts;
static long born[MAX_WORKERS + 1]; /* the generation before a worker's first job: set before it starts */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *work(void *arg) {
    const int64_t part = (int64_t)(intptr_t)arg;
    long seen = born[part];
    for (;;) {
        const int64_t since = now_ns();
        for (int64_t spins = 0; atomic_load_explicit(&generation, memory_order_acquire) == seen; spins++) {
            _mm_pause();
            if (spins % 256 == 255) {
                sched_yield(); /* a thread with work on this CPU goes first */
                if (now_ns() - since > SPIN_NS) {
                    pthread_mutex_lock(&sleep_lock);
                    sleepers++;
                    while (atomic_load_explicit(&generation, memory_order_acquire) == seen) pthread_cond_wait(&woken, &sleep_lock);
                    sleepers--;
                    pthread_mutex_unlock(&sleep_lock);
                }
            }
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        if (part < job_parts) job_task(job_ctx, part, job_parts);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

/* After fork the child has none of the parent's workers: it starts its own. */
static void forget_workers(void) {
    pthread_mutex_init(&running, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&woken, NULL);
    sleepers = workers = 0;
}

void pool_run(pool_task task, void *ctx, int64_t parts) {
    if (parts <= 1) {
        task(ctx, 0, 1);
        return;
    }
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    pthread_mutex_lock(&running);
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, forget_workers);
    while (workers < parts - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[workers + 1] = atomic_load(&generation);
        const int failed = pthread_create(&thread, &attr, work, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
    if (parts > workers + 1) parts = workers + 1; /* fewer threads than asked: the parts still cover the work */
    job_task = task, job_ctx = ctx, job_parts = parts;
    atomic_store_explicit(&pending, workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_mutex_lock(&sleep_lock);
    if (sleepers) pthread_cond_broadcast(&woken);
    pthread_mutex_unlock(&sleep_lock);
    task(ctx, 0, parts);
    for (int64_t spins = 0; atomic_load_explicit(&pending, memory_order_acquire) > 0; spins++) {
        _mm_pause();
        if (spins % 256 == 255) sched_yield();
    }
    pthread_mutex_unlock(&running);
}
