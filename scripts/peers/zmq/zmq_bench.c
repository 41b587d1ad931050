/*
 * zmq_bench: ZeroMQ (libzmq) over TCP loopback, two processes, measured the way `hf bench`
 * measures hyperframes, so that scripts/compare.py can put the figures side by side.
 *
 *   zmq_bench --pattern lat|rate|bw --size BYTES --duration SECS [--pin A,B] [--port N]
 *
 * The runner (this process) forks and re-executes itself as the peer (hidden --peer-role
 * argument), pinned to the second CPU of --pin while the runner is pinned to the first. The
 * peer binds on 127.0.0.1 and reports its endpoints through a pipe; only then does the runner
 * connect.
 *
 *   lat   REQ (runner) -> REP (peer, echoes): half of each round trip, p50 and p99.
 *   rate  PUSH (runner) -> PULL (peer): the peer counts; msgs/s from the first measured
 *         message received to the last one.
 *   bw    as rate; the peer also reads every byte of every message; GB/s (1e9 B/s).
 *
 * Per run: 0.5 s warm-up of the same traffic, a zero-length marker (rate/bw: "measuring
 * starts"), the measured traffic, a zero-length end marker; then the runner asks the peer
 * for its figures over a second (REQ/REP) control socket and prints one JSON line.
 *
 * Build: cc -O2 -o zmq_bench zmq_bench.c -lzmq
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define WARMUP_NS 500000000ull /* 0.5 s */
#define NBUFS 8                /* distinct send buffers, rotated (as hf bench does) */
#define TIMEOUT_MS 10000       /* a socket that waits longer than this means the run failed */

enum pattern { LAT, RATE, BW };
static const char *pattern_name[] = {"lat", "rate", "bw"};

static volatile pid_t child = 0; /* the peer, while it runs (runner only) */
static volatile sig_atomic_t peer_may_exit = 0;
static const char *role = "zmq_bench";

static void kill_child(void) {
    pid_t c = child;
    peer_may_exit = 1;
    if (c > 0) {
        kill(c, SIGKILL);
        waitpid(c, NULL, 0);
        child = 0;
    }
}

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", role);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    kill_child();
    exit(1);
}

/* SIGCHLD before the peer has answered: it died; stop now rather than at a socket timeout. */
static void on_child(int sig) {
    (void)sig;
    pid_t c = child;
    int st;
    if (peer_may_exit || c <= 0 || waitpid(c, &st, WNOHANG) != c)
        return;
    child = 0;
    static const char msg[] = "zmq_bench: the peer died during the run\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    _exit(1);
}

/* SIGALRM (watchdog), SIGINT, SIGTERM: take the peer down with us. */
static void on_signal(int sig) {
    pid_t c = child;
    if (c > 0) {
        kill(c, SIGKILL);
        waitpid(c, NULL, 0);
    }
    static const char msg[] = "zmq_bench: interrupted or timed out; peer killed\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
    }
    _exit(sig == SIGALRM ? 2 : 128 + sig);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void pin(int cpu) {
    if (cpu < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
        die("cannot pin to CPU %d: %s", cpu, strerror(errno));
}

static void setopt_int(void *s, int opt, int v) {
    if (zmq_setsockopt(s, opt, &v, sizeof v) != 0)
        die("zmq_setsockopt(%d): %s", opt, zmq_strerror(zmq_errno()));
}

/* Socket options common to both sides: bounded waits, bounded linger, and high-water marks
 * sized in bytes (~64 MiB of queue each way, 1000 messages at most, the libzmq default), so
 * that PUSH blocks (its action in the mute state; it never drops) instead of queueing
 * gigabytes of 4 MiB messages. */
static void common_opts(void *s, size_t size) {
    size_t hwm = (64u << 20) / (size ? size : 1);
    if (hwm > 1000)
        hwm = 1000;
    if (hwm < 4)
        hwm = 4;
    setopt_int(s, ZMQ_SNDHWM, (int)hwm);
    setopt_int(s, ZMQ_RCVHWM, (int)hwm);
    setopt_int(s, ZMQ_LINGER, 2000);
    setopt_int(s, ZMQ_SNDTIMEO, TIMEOUT_MS);
    setopt_int(s, ZMQ_RCVTIMEO, TIMEOUT_MS);
}

/* Reads every 8-byte word of the message (a sum nobody looks at). */
static uint64_t touch(const unsigned char *b, size_t n) {
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        s += w;
    }
    for (; i < n; i++)
        s += b[i];
    return s;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* ------------------------------------------------------------------------- peer side */

static void peer_recv(void *s, zmq_msg_t *m) {
    if (zmq_msg_recv(m, s, 0) < 0)
        die("peer: recv: %s", zmq_strerror(zmq_errno()));
}

static int peer_main(int ready_fd, enum pattern pat, size_t size, int port) {
    role = "zmq_bench peer";
    void *ctx = zmq_ctx_new();
    void *data = zmq_socket(ctx, pat == LAT ? ZMQ_REP : ZMQ_PULL);
    void *ctl = zmq_socket(ctx, ZMQ_REP);
    if (!ctx || !data || !ctl)
        die("zmq: %s", zmq_strerror(zmq_errno()));
    common_opts(data, size);
    common_opts(ctl, 64);
    /* The run itself may be long; only the control socket's wait is bounded tightly. */
    setopt_int(data, ZMQ_RCVTIMEO, -1);
    char ep[256];
    if (port > 0)
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    else
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:*");
    if (zmq_bind(data, ep) != 0)
        die("bind %s: %s", ep, zmq_strerror(zmq_errno()));
    if (zmq_bind(ctl, "tcp://127.0.0.1:*") != 0)
        die("bind control: %s", zmq_strerror(zmq_errno()));
    char data_ep[256], ctl_ep[256];
    size_t l1 = sizeof data_ep, l2 = sizeof ctl_ep;
    zmq_getsockopt(data, ZMQ_LAST_ENDPOINT, data_ep, &l1);
    zmq_getsockopt(ctl, ZMQ_LAST_ENDPOINT, ctl_ep, &l2);
    /* Listening: tell the runner. */
    dprintf(ready_fd, "%s %s\n", data_ep, ctl_ep);
    close(ready_fd);

    uint64_t warm = 0, messages = 0, bytes = 0, sum = 0;
    uint64_t first = 0, last = 0, clocked = 0;
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (pat == LAT) {
        /* Echo everything, the zero-length markers too (REQ waits for a reply): the first
         * ends the warm-up, the second the run. */
        int phase = 0;
        for (;;) {
            peer_recv(data, &m);
            size_t n = zmq_msg_size(&m);
            if (zmq_msg_send(&m, data, 0) < 0)
                die("echo: %s", zmq_strerror(zmq_errno()));
            if (n == 0) {
                if (++phase == 2)
                    break;
            } else if (phase == 0) {
                warm++;
            } else {
                messages++;
                bytes += n;
            }
        }
    } else {
        int phase = 0; /* 0 warm-up, 1 measured; the second marker ends the run */
        for (;;) {
            peer_recv(data, &m);
            size_t n = zmq_msg_size(&m);
            if (n == 0) {
                if (++phase == 2)
                    break;
                continue;
            }
            if (pat == BW)
                sum += touch(zmq_msg_data(&m), n);
            if (phase == 0) {
                warm++;
                continue;
            }
            messages++;
            bytes += n;
            /* The clock costs ~20 ns: read it for the first message, for every large one
             * and every 16th small one; the end marker clocks the rest (as hf bench). */
            if (first == 0 || n >= 4096 || (messages & 15) == 0) {
                last = now_ns();
                if (first == 0)
                    first = last;
                clocked = messages;
            }
        }
        if (clocked < messages)
            last = now_ns();
    }
    zmq_msg_close(&m);

    /* The runner's request for the figures. */
    char req[64];
    if (zmq_recv(ctl, req, sizeof req, 0) < 0)
        die("control recv: %s", zmq_strerror(zmq_errno()));
    char rep[256];
    int len = snprintf(rep, sizeof rep, "%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64,
                       messages, bytes, last - first, warm, sum);
    if (zmq_send(ctl, rep, (size_t)len, 0) < 0)
        die("control send: %s", zmq_strerror(zmq_errno()));
    zmq_close(data);
    zmq_close(ctl); /* linger: the reply still goes out */
    zmq_ctx_term(ctx);
    return 0;
}

/* ----------------------------------------------------------------------- runner side */

static void usage(void) {
    fprintf(stderr,
            "usage: zmq_bench --pattern lat|rate|bw --size BYTES --duration SECS "
            "[--pin A,B] [--port N]\n");
    exit(2);
}

static const char *why(void) {
    int e = zmq_errno();
    return e == EAGAIN ? "no progress for 10 s" : zmq_strerror(e);
}

static void send_or_die(void *s, const void *b, size_t n) {
    if (zmq_send(s, b, n, 0) < 0)
        die("send: %s", why());
}

static void recv_or_die(void *s, void *b, size_t n) {
    if (zmq_recv(s, b, n, 0) < 0)
        die("recv: %s", why());
}

int main(int argc, char **argv) {
    const char *pattern_s = NULL;
    long long size_ll = -1;
    double duration = -1;
    int pin_a = -1, pin_b = -1, port = 0, ready_fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--pattern"))
            pattern_s = v;
        else if (!strcmp(a, "--size"))
            size_ll = atoll(v);
        else if (!strcmp(a, "--duration"))
            duration = atof(v);
        else if (!strcmp(a, "--port"))
            port = atoi(v);
        else if (!strcmp(a, "--pin")) {
            if (sscanf(v, "%d,%d", &pin_a, &pin_b) != 2)
                usage();
        } else if (!strcmp(a, "--peer-role"))
            ready_fd = atoi(v);
        else
            usage();
        i++;
    }
    enum pattern pat;
    if (!pattern_s)
        usage();
    if (!strcmp(pattern_s, "lat"))
        pat = LAT;
    else if (!strcmp(pattern_s, "rate"))
        pat = RATE;
    else if (!strcmp(pattern_s, "bw"))
        pat = BW;
    else
        usage();
    if (size_ll < 1) {
        fprintf(stderr, "zmq_bench: --size must be at least 1 (zero-length messages are the "
                        "bench's markers)\n");
        exit(2);
    }
    size_t size = (size_t)size_ll;
    if (ready_fd >= 0)
        return peer_main(ready_fd, pat, size, port);
    if (duration <= 0)
        usage();

    /* Pin first: the context's I/O thread, created later, inherits the CPU. */
    pin(pin_a);

    signal(SIGALRM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, on_child);
    alarm((unsigned)(duration + 0.5) + 60);

    int fds[2];
    if (pipe(fds) != 0)
        die("pipe: %s", strerror(errno));
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        /* The peer: dies with the runner, runs on the second CPU. */
        close(fds[0]);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        if (pin_b >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(pin_b, &set);
            if (sched_setaffinity(0, sizeof set, &set) != 0) {
                perror("zmq_bench peer: sched_setaffinity");
                _exit(1);
            }
        }
        char fd_s[16], size_s[32], port_s[16];
        snprintf(fd_s, sizeof fd_s, "%d", fds[1]);
        snprintf(size_s, sizeof size_s, "%zu", size);
        snprintf(port_s, sizeof port_s, "%d", port);
        char *args[] = {argv[0], "--peer-role", fd_s, "--pattern", (char *)pattern_s,
                        "--size", size_s, "--port", port_s, NULL};
        execv("/proc/self/exe", args);
        perror("zmq_bench: exec");
        _exit(127);
    }
    child = pid;
    close(fds[1]);

    /* Wait for the peer to listen: it writes its endpoints, then closes the pipe. */
    char line[600];
    size_t got = 0;
    for (;;) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        int r = poll(&p, 1, TIMEOUT_MS);
        if (r == 0)
            die("the peer did not start listening within %d ms", TIMEOUT_MS);
        if (r < 0 && errno == EINTR)
            continue;
        ssize_t n = read(fds[0], line + got, sizeof line - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
        if (memchr(line, '\n', got) || got == sizeof line - 1)
            break;
    }
    close(fds[0]);
    line[got] = 0;
    char data_ep[300], ctl_ep[300];
    if (sscanf(line, "%299s %299s", data_ep, ctl_ep) != 2)
        die("the peer exited before listening");

    void *ctx = zmq_ctx_new();
    void *data = zmq_socket(ctx, pat == LAT ? ZMQ_REQ : ZMQ_PUSH);
    void *ctl = zmq_socket(ctx, ZMQ_REQ);
    if (!ctx || !data || !ctl)
        die("zmq: %s", zmq_strerror(zmq_errno()));
    common_opts(data, size);
    common_opts(ctl, 64);
    if (zmq_connect(data, data_ep) != 0 || zmq_connect(ctl, ctl_ep) != 0)
        die("connect: %s", zmq_strerror(zmq_errno()));

    unsigned char *bufs[NBUFS];
    for (int k = 0; k < NBUFS; k++) {
        bufs[k] = malloc(size);
        if (!bufs[k])
            die("out of memory");
        for (size_t i = 0; i < size; i++)
            bufs[k][i] = (unsigned char)(i * 31 + k);
    }
    unsigned char *rbuf = malloc(size);
    if (!rbuf)
        die("out of memory");

    uint64_t dur_ns = (uint64_t)(duration * 1e9);
    uint64_t sent = 0, *rtt = NULL;
    size_t nrtt = 0, cap = 0;
    double runner_seconds = 0;

    if (pat == LAT) {
        uint64_t t = now_ns(), end = t + WARMUP_NS;
        for (uint64_t k = 0; now_ns() < end; k++) {
            send_or_die(data, bufs[k % NBUFS], size);
            recv_or_die(data, rbuf, size);
        }
        send_or_die(data, "", 0); /* measuring starts */
        recv_or_die(data, rbuf, size);
        uint64_t t0 = now_ns();
        end = t0 + dur_ns;
        for (;;) {
            uint64_t s0 = now_ns();
            if (s0 >= end)
                break;
            send_or_die(data, bufs[sent % NBUFS], size);
            int n = zmq_recv(data, rbuf, size, 0);
            if (n < 0)
                die("recv: %s", why());
            if ((size_t)n != size)
                die("echo of %d bytes for a %zu-byte ping", n, size);
            uint64_t s1 = now_ns();
            if (nrtt == cap) {
                cap = cap ? cap * 2 : 1 << 16;
                rtt = realloc(rtt, cap * sizeof *rtt);
                if (!rtt)
                    die("out of memory");
            }
            rtt[nrtt++] = s1 - s0;
            sent++;
        }
        runner_seconds = (double)(now_ns() - t0) / 1e9;
        send_or_die(data, "", 0); /* end */
        recv_or_die(data, rbuf, size);
    } else {
        uint64_t end = now_ns() + WARMUP_NS;
        for (uint64_t k = 0; now_ns() < end; k++)
            send_or_die(data, bufs[k % NBUFS], size);
        send_or_die(data, "", 0); /* measuring starts */
        uint64_t t0 = now_ns();
        end = t0 + dur_ns;
        /* zmq_send copies the (reused) buffer into a fresh message of its own. */
        for (;;) {
            if ((size >= 4096 || (sent & 15) == 0) && now_ns() >= end)
                break;
            send_or_die(data, bufs[sent % NBUFS], size);
            sent++;
        }
        send_or_die(data, "", 0); /* end */
    }

    /* Collect the peer's figures. */
    send_or_die(ctl, "result", 6);
    char rep[256];
    int n = zmq_recv(ctl, rep, sizeof rep - 1, 0);
    if (n < 0)
        die("the peer sent no result: %s", why());
    rep[n] = 0;
    peer_may_exit = 1; /* it has answered: from here on it ends by itself */
    uint64_t messages, bytes, span_ns, warm, sum;
    if (sscanf(rep, "%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &messages,
               &bytes, &span_ns, &warm, &sum) != 5)
        die("bad result from the peer: %s", rep);
    zmq_close(data);
    zmq_close(ctl);
    while (zmq_ctx_term(ctx) != 0 && zmq_errno() == EINTR) /* SIGCHLD: the peer's exit */
        ;

    /* The peer ends by itself once it has answered; reap it. */
    int status = 0;
    for (int i = 0;; i++) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid)
            break;
        if (i == 500)
            die("the peer did not exit");
        usleep(10000);
    }
    child = 0;
    alarm(0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "zmq_bench: the peer failed (status %d)\n", status);
        return 1;
    }

    int major, minor, patch;
    zmq_version(&major, &minor, &patch);
    int64_t lost;
    uint64_t received;
    char msgs_s[64] = "null", gb_s[64] = "null", p50_s[64] = "null", p99_s[64] = "null";
    double seconds;
    if (pat == LAT) {
        /* The peer counts the measured pings it echoed (after the warm-up ones). */
        lost = (int64_t)sent - (int64_t)messages;
        seconds = runner_seconds;
        qsort(rtt, nrtt, sizeof *rtt, cmp_u64);
        if (nrtt > 0) {
            size_t i50 = (nrtt - 1) / 2, i99 = (size_t)((double)nrtt * 0.99);
            if (i99 >= nrtt)
                i99 = nrtt - 1;
            snprintf(p50_s, sizeof p50_s, "%.3f", rtt[i50] / 2.0 / 1e3);
            snprintf(p99_s, sizeof p99_s, "%.3f", rtt[i99] / 2.0 / 1e3);
            snprintf(msgs_s, sizeof msgs_s, "%.1f", (double)nrtt / runner_seconds);
        }
        received = messages;
        messages = sent;
    } else {
        received = messages;
        lost = (int64_t)sent - (int64_t)messages;
        seconds = (double)span_ns / 1e9;
        if (messages >= 2 && span_ns > 0) {
            double rate = (double)(messages - 1) / seconds;
            snprintf(msgs_s, sizeof msgs_s, "%.1f", rate);
            snprintf(gb_s, sizeof gb_s, "%.6f", rate * (double)bytes / (double)messages / 1e9);
        }
    }
    printf("{\"tool\":\"zeromq\",\"version\":\"%d.%d.%d\",\"pattern\":\"%s\",\"size\":%zu,"
           "\"messages\":%" PRIu64 ",\"lost\":%" PRId64 ",\"seconds\":%.6f,\"msgs_per_s\":%s,"
           "\"gbytes_per_s\":%s,\"lat_p50_us\":%s,\"lat_p99_us\":%s}\n",
           major, minor, patch, pattern_name[pat], size, messages, lost, seconds, msgs_s, gb_s,
           p50_s, p99_s);
    fflush(stdout);
    if (lost != 0) {
        fprintf(stderr, "zmq_bench: the peer received %" PRIu64 " of %" PRIu64 " messages\n",
                received, sent);
        return 1;
    }
    if (pat != LAT && messages < 2) {
        fprintf(stderr, "zmq_bench: too few messages to measure a rate; use a longer --duration\n");
        return 1;
    }
    return 0;
}
