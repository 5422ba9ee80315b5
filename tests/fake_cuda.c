/* A stand-in for the parts of the CUDA runtime, the CUDA driver and c10 that gputrace's C hot path
 * calls, for tests on machines without a GPU: an event takes the host's monotonic time and the
 * stream it was recorded on, and has run at once. Counters say which calls were made. */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    long long t;
    void *stream;
    int recorded;
} Event;

static long long now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int current_device;
long long created, runtime_records, driver_records, driver_refusals, runtime_elapsed;
int driver_fails;  /* nonzero: the driver's record refuses with this error */
int elapsed_fails; /* nonzero: the driver's elapsed read refuses with this error */
void *current_stream;  /* what c10 says the current stream is */

int cudaEventCreateWithFlags(void **ev, unsigned flags) {
    (void)flags;
    Event *e = calloc(1, sizeof(Event));
    if (!e) return 2;
    created++;
    *ev = e;
    return 0;
}
static int record(void *ev, void *stream) {
    Event *e = ev;
    e->t = now();
    e->stream = stream;
    e->recorded = 1;
    return 0;
}
int cudaEventRecord(void *ev, void *stream) {
    runtime_records++;
    return record(ev, stream);
}
int cuEventRecord(void *ev, void *stream) {
    if (driver_fails) {
        driver_refusals++;
        return driver_fails;
    }
    driver_records++;
    return record(ev, stream);
}
int cudaEventQuery(void *ev) { return ((Event *)ev)->recorded ? 0 : 400; }
int cudaEventSynchronize(void *ev) { return ((Event *)ev)->recorded ? 0 : 400; }
int cudaEventDestroy(void *ev) {
    free(ev);
    return 0;
}
static int elapsed(float *ms, void *a, void *b) {
    Event *x = a, *y = b;
    if (!x->recorded || !y->recorded) return 400;
    *ms = (float)((double)(y->t - x->t) / 1e6);
    return 0;
}
int cuEventElapsedTime(float *ms, void *a, void *b) { return elapsed_fails ? elapsed_fails : elapsed(ms, a, b); }
int cudaEventElapsedTime(float *ms, void *a, void *b) {
    runtime_elapsed++;
    return elapsed(ms, a, b);
}
int cudaGetLastError(void) { return 0; }
int cudaGetDevice(int *d) {
    *d = current_device;
    return 0;
}
int cudaSetDevice(int d) {
    current_device = d;
    return 0;
}
void *event_stream(void *ev) { return ((Event *)ev)->stream; }

typedef struct {
    int64_t device, id;
} Stream;
int8_t c10_current_device(void) { return (int8_t)current_device; }
Stream c10_current_stream(int8_t device) {
    Stream s = {device, (int64_t)(intptr_t)current_stream};
    return s;
}
void *c10_stream(const Stream *s) { return (void *)(intptr_t)s->id; }
