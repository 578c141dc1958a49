/* Parking the model thread's OpenMP workers while it has nothing to run.
 *
 * After a parallel region the runtime's workers spin, waiting for the next one, before they sleep
 * (libgomp: about 3 ms on the CPUs measured). Between the passes of one pass's layers that is what
 * keeps them fast, and passes verified ahead run back to back; but when the model thread goes idle
 * (its service waits for a request), those spinning workers hold the cores the request's own path
 * needs: the service's event loop, and on a shared machine the caller and the draft. Parked, every
 * thread of the team sleeps in the kernel until `specdec_unpark` (or the timeout), then the region
 * ends and the next pass finds its workers awake.
 *
 * A ticket closes the race with a wake-up that comes before the park: take one (`specdec_park_ticket`)
 * before handing the park to the model thread; a park whose ticket is older than the last unpark
 * returns at once. */

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "status.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t woken = PTHREAD_COND_INITIALIZER;
static uint64_t unparks; /* the unparks so far: a park waits while it is its ticket */

uint64_t specdec_park_ticket(void) {
    pthread_mutex_lock(&lock);
    uint64_t ticket = unparks;
    pthread_mutex_unlock(&lock);
    return ticket;
}

void specdec_unpark(void) {
    pthread_mutex_lock(&lock);
    unparks++;
    pthread_cond_broadcast(&woken);
    pthread_mutex_unlock(&lock);
}

/* Sleep on `threads` threads of the caller's OpenMP team until an unpark after `ticket`, or
 * `timeout_ms`. */
int specdec_park(uint64_t ticket, int threads, int timeout_ms) {
    if (threads < 1 || timeout_ms < 0) return SPECDEC_BAD_SHAPE;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
#pragma omp parallel num_threads(threads)
    {
        pthread_mutex_lock(&lock);
        int rc = 0;
        while (unparks == ticket && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&woken, &lock, &until);
        pthread_mutex_unlock(&lock);
    }
    return SPECDEC_OK;
}
