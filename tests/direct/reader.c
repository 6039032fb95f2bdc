/* Reads files of a stagefs mount and compares them with the source, as an unmodified program
 * would (open/openat/fopen/fopen64), retrying each file until its descriptor is a direct one
 * (/proc/self/fd/N names a file outside the mount) or a deadline passes. fstat of the
 * descriptor must show the file stat shows for its path (as cp checks), direct or not.
 * Used by tests/direct.rs.
 *   reader MNT SRC WAIT_S FILE...   exit 0: all equal and all direct (WAIT_S 0: no retries,
 *                                    then exit 0 if all equal; prints how many were direct)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char *slurp_fd(int fd, size_t *len) {
    size_t cap = 1 << 20, n = 0;
    char *b = malloc(cap);
    for (;;) {
        if (n == cap) b = realloc(b, cap *= 2);
        ssize_t r = read(fd, b + n, cap - n);
        if (r < 0) { perror("read"); exit(3); }
        if (r == 0) break;
        n += (size_t)r;
    }
    *len = n;
    return b;
}

static char *slurp_fp(FILE *fp, size_t *len) {
    size_t cap = 1 << 20, n = 0;
    char *b = malloc(cap);
    for (;;) {
        if (n == cap) b = realloc(b, cap *= 2);
        size_t r = fread(b + n, 1, cap - n, fp);
        if (r == 0) break;
        n += r;
    }
    *len = n;
    return b;
}

int main(int argc, char **argv) {
    if (argc < 5) return 64;
    const char *mnt = argv[1], *src = argv[2];
    int wait_s = atoi(argv[3]);
    struct stat m;
    if (stat(mnt, &m) != 0) { perror("stat mnt"); return 3; }
    int dmnt = open(mnt, O_RDONLY | O_DIRECTORY);
    int direct = 0, files = 0;
    for (int i = 4; i < argc; i++, files++) {
        char p[4096], s[4096];
        snprintf(p, sizeof p, "%s/%s", mnt, argv[i]);
        snprintf(s, sizeof s, "%s/%s", src, argv[i]);
        time_t until = time(NULL) + wait_s;
        int how = (i - 4) % 4, is_direct = 0;
        size_t n = 0;
        char *got = NULL;
        for (;;) {
            int fd = -1;
            FILE *fp = NULL;
            if (how == 0) fd = open(p, O_RDONLY);
            else if (how == 1) fd = openat(dmnt, argv[i], O_RDONLY | O_CLOEXEC);
            else if (how == 2) fp = fopen(p, "rb");
            else fp = fopen64(p, "re");
            if (fp) fd = fileno(fp);
            if (fd < 0) { fprintf(stderr, "open %s: %s\n", p, strerror(errno)); return 3; }
            struct stat st, ps;
            char link[4096], proc[64];
            snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
            ssize_t ln = readlink(proc, link, sizeof link - 1);
            link[ln < 0 ? 0 : ln] = 0;
            is_direct = strncmp(link, mnt, strlen(mnt)) != 0;
            if (fstat(fd, &st) != 0 || stat(p, &ps) != 0 || st.st_dev != ps.st_dev ||
                st.st_ino != ps.st_ino || st.st_size != ps.st_size || st.st_dev != m.st_dev) {
                fprintf(stderr, "%s: fstat of the descriptor is not the path's file\n", p);
                return 6;
            }
            int cloexec = fcntl(fd, F_GETFD) & FD_CLOEXEC;
            int want_cloexec = how == 1 || how == 3;
            if (cloexec != (want_cloexec ? FD_CLOEXEC : 0)) {
                fprintf(stderr, "%s: close-on-exec %d, asked %d\n", p, cloexec, want_cloexec);
                return 4;
            }
            free(got);
            got = fp ? slurp_fp(fp, &n) : slurp_fd(fd, &n);
            if (fp) fclose(fp); else close(fd);
            if (is_direct || time(NULL) >= until) break;
            usleep(50000);
        }
        int sfd = open(s, O_RDONLY);
        size_t sn;
        char *want = slurp_fd(sfd, &sn);
        close(sfd);
        if (sn != n || memcmp(want, got, n) != 0) {
            fprintf(stderr, "%s: bytes differ (%zu vs %zu)\n", p, n, sn);
            return 2;
        }
        free(want);
        free(got);
        direct += is_direct;
    }
    printf("direct %d of %d\n", direct, files);
    return (wait_s == 0 || direct == files) ? 0 : 5;
}
