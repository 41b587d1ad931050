/*
 * c2c: the cost of handing a cache line from one CPU to another and back, the floor under
 * every shared-memory latency figure (shm://, inproc://, UCX posix, iceoryx2).
 *
 *   cc -O2 -pthread -o c2c c2c.c
 *   ./c2c [--pin A,B] [--rounds N]
 *
 * Two threads ping-pong a counter on one 64-byte-aligned line: the first writes odd values
 * and waits for the next even one, the second answers. Eleven batches of N round trips;
 * prints one JSON line with the median one-way time (half a round trip) in nanoseconds, and
 * the fastest and slowest batch. Unpinned (no --pin), the scheduler places the threads.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BATCHES 11

static _Alignas(128) _Atomic unsigned long line;
static long rounds = 200000;
static int cpu_a = -1, cpu_b = -1;

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
        fprintf(stderr, "c2c: cannot pin to CPU %d\n", cpu);
        exit(1);
    }
}

static void *answer(void *arg) {
    (void)arg;
    pin(cpu_b);
    unsigned long want = 1;
    for (long i = 0; i < rounds * BATCHES; i++, want += 2) {
        while (atomic_load_explicit(&line, memory_order_acquire) != want)
            __builtin_ia32_pause();
        atomic_store_explicit(&line, want + 1, memory_order_release);
    }
    return NULL;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--pin") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d,%d", &cpu_a, &cpu_b) != 2) {
                fprintf(stderr, "c2c: --pin A,B\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atol(argv[++i]);
        } else {
            fprintf(stderr, "usage: c2c [--pin A,B] [--rounds N]\n");
            return 2;
        }
    }
    pthread_t t;
    if (pthread_create(&t, NULL, answer, NULL) != 0) {
        fprintf(stderr, "c2c: cannot start a thread\n");
        return 1;
    }
    pin(cpu_a);
    double one_way[BATCHES];
    unsigned long v = 1;
    for (int b = 0; b < BATCHES; b++) {
        double t0 = now_ns();
        for (long i = 0; i < rounds; i++, v += 2) {
            atomic_store_explicit(&line, v, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != v + 1)
                __builtin_ia32_pause();
        }
        one_way[b] = (now_ns() - t0) / rounds / 2;
    }
    pthread_join(t, NULL);
    qsort(one_way, BATCHES, sizeof one_way[0], cmp);
    printf("{\"tool\":\"c2c\",\"pinned\":%s,\"rounds\":%ld,\"one_way_ns\":%.1f,"
           "\"min_ns\":%.1f,\"max_ns\":%.1f}\n",
           cpu_a >= 0 ? "true" : "false", rounds, one_way[BATCHES / 2], one_way[0],
           one_way[BATCHES - 1]);
    return 0;
}
