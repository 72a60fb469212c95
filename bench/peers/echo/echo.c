// The host's own bound for a call: a round trip of `bytes` over loopback TCP between two
// processes with nothing else in the way (blocking sockets, no parsing, no copies beyond the
// kernel's). The parent sends `bytes`, the child reads them all and sends them back; `count`
// times, one at a time. A Petrel call is two such round trips (caller -> server -> replier and
// back), so it cannot beat half this rate, and its payload crosses loopback four times.
//
//   cc -O2 -o echo echo.c && ./echo BYTES COUNT
//   prints: {"bytes": B, "round_trips_per_sec": R, "call_bound_per_sec": R/2, "call_bound_mb_per_sec": ...}
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void read_all(int fd, char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = read(fd, buf, len);
        if (n == 0) {
            fprintf(stderr, "read: the other end closed the connection\n");
            exit(1);
        }
        if (n < 0) die("read");
        buf += n;
        len -= (size_t)n;
    }
}

static void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n <= 0) die("write");
        buf += n;
        len -= (size_t)n;
    }
}

static void no_delay(int fd) {
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) die("setsockopt");
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s BYTES COUNT\n", argv[0]);
        return 2;
    }
    size_t bytes = strtoull(argv[1], NULL, 10);
    long count = strtol(argv[2], NULL, 10);
    if (bytes == 0 || count <= 0) {
        fprintf(stderr, "BYTES and COUNT must be at least 1\n");
        return 2;
    }
    char *buf = calloc(1, bytes);
    if (buf == NULL) die("calloc");

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    if (listener < 0) die("socket");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t addr_len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0) die("bind");
    if (listen(listener, 1) != 0) die("listen");
    if (getsockname(listener, (struct sockaddr *)&addr, &addr_len) != 0) die("getsockname");

    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        int fd = accept(listener, NULL, NULL);
        if (fd < 0) die("accept");
        no_delay(fd);
        for (long i = 0; i < count; i++) {
            read_all(fd, buf, bytes);
            write_all(fd, buf, bytes);
        }
        _exit(0);
    }
    close(listener);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
    no_delay(fd);

    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < count; i++) {
        write_all(fd, buf, bytes);
        read_all(fd, buf, bytes);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    int status;
    waitpid(child, &status, 0);
    double secs = (double)(end.tv_sec - start.tv_sec) + (double)(end.tv_nsec - start.tv_nsec) / 1e9;
    double rate = (double)count / secs;
    printf("{\"bytes\": %zu, \"round_trips_per_sec\": %.1f, \"call_bound_per_sec\": %.1f, "
           "\"call_bound_mb_per_sec\": %.1f}\n",
           bytes, rate, rate / 2, rate / 2 * (double)bytes / 1e6);
    return 0;
}
