// scripts/link_delay.c: holds every packet of one netfilter queue for a fixed
// time, then lets it go, in arrival order. scripts/cluster.sh builds it and
// runs one inside each host's network namespace to delay what the host sends
// where the kernel has no netem (Note [Delay without netem] in cluster.sh).
//
//   link_delay QUEUE DELAY_US READY_FILE
//
// Binds netfilter queue QUEUE of this network namespace, writes READY_FILE
// once bound, and accepts each queued packet DELAY_US microseconds after it
// arrived. Only the packets' metadata is copied (their ids): what is held
// stays in the kernel. On SIGTERM or SIGINT it lets every held packet go and
// prints how many packets it held and their mean hold time.
#define _GNU_SOURCE  // ppoll
// glibc's <arpa/inet.h> before the kernel's headers, which defer to it.
#include <arpa/inet.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

// Held packets in arrival order: a ring that grows when full.
typedef struct {
  uint32_t id;
  int64_t release_ns;
} Held;

static Held* held;
static size_t capacity = 1 << 16, head, count;
static int64_t delay_ns;
static uint64_t total, hold_ns_sum, overflows;
static int64_t read_ns;  // when the messages being handled were read
static volatile sig_atomic_t stopping;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void push(uint32_t id, int64_t release_ns) {
  if (count == capacity) {
    Held* bigger = malloc(2 * capacity * sizeof(Held));
    if (!bigger) {
      perror("link_delay: malloc");
      exit(1);
    }
    for (size_t i = 0; i < count; ++i) bigger[i] = held[(head + i) % capacity];
    free(held);
    held = bigger;
    head = 0;
    capacity *= 2;
  }
  held[(head + count) % capacity] = (Held){id, release_ns};
  ++count;
}

static int on_packet(struct nfq_q_handle* qh, struct nfgenmsg* msg, struct nfq_data* data, void* arg) {
  (void)qh, (void)msg, (void)arg;
  struct nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(data);
  if (ph) push(ntohl(ph->packet_id), read_ns + delay_ns);
  return 0;
}

// Accepts every held packet due by `now` (all of them when `all`): ids grow
// in arrival order, so one batch verdict covers the run.
static void release(struct nfq_q_handle* qh, int64_t now, int all) {
  uint32_t last = 0;
  size_t n = 0;
  while (count > 0 && (all || held[head].release_ns <= now)) {
    last = held[head].id;
    hold_ns_sum += (uint64_t)(now - (held[head].release_ns - delay_ns));
    head = (head + 1) % capacity;
    --count;
    ++n;
  }
  if (n == 0) return;
  total += n;
  if (nfq_set_verdict_batch(qh, last, NF_ACCEPT) < 0) {
    perror("link_delay: verdict");
    exit(1);
  }
}

static void on_signal(int sig) {
  (void)sig;
  stopping = 1;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: link_delay QUEUE DELAY_US READY_FILE\n");
    return 2;
  }
  char* end = NULL;
  const long queue = strtol(argv[1], &end, 10);
  if (*end != '\0' || queue < 0 || queue > 65535) {
    fprintf(stderr, "link_delay: QUEUE '%s' must be 0 to 65535\n", argv[1]);
    return 2;
  }
  const double us = strtod(argv[2], &end);
  if (*end != '\0' || !(us >= 0) || us > 60e6) {
    fprintf(stderr, "link_delay: DELAY_US '%s' must be 0 to 60000000 microseconds\n", argv[2]);
    return 2;
  }
  delay_ns = (int64_t)(us * 1e3);
  held = malloc(capacity * sizeof(Held));
  struct nfq_handle* h = nfq_open();
  if (!h || !held) {
    perror("link_delay: nfq_open (needs root and the kernel's nfnetlink_queue)");
    return 1;
  }
  struct nfq_q_handle* qh = nfq_create_queue(h, (uint16_t)queue, on_packet, NULL);
  if (!qh) {
    perror("link_delay: nfq_create_queue (is the queue bound by another process?)");
    return 1;
  }
  // Metadata only; GSO packets whole, as the stack built them.
  if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(qh, 1 << 20) < 0) {
    perror("link_delay: configuring the queue");
    return 1;
  }
  nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
  nfnl_rcvbufsiz(nfq_nfnlh(h), 32 << 20);
  const int fd = nfq_fd(h);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  FILE* ready = fopen(argv[3], "w");
  if (!ready) {
    perror("link_delay: READY_FILE");
    return 1;
  }
  fprintf(ready, "%d\n", (int)getpid());
  fclose(ready);

  static char buf[1 << 16];
  while (!stopping) {
    const int64_t now = now_ns();
    release(qh, now, 0);
    struct timespec wait = {1, 0}, *timeout = &wait;
    if (count > 0) {
      const int64_t left = held[head].release_ns - now;
      wait.tv_sec = left / 1000000000;
      wait.tv_nsec = left % 1000000000;
    }
    struct pollfd p = {fd, POLLIN, 0};
    const int r = ppoll(&p, 1, timeout, NULL);
    if (r < 0 && errno != EINTR) {
      perror("link_delay: ppoll");
      return 1;
    }
    if (r <= 0) continue;
    // Everything waiting on the socket, stamped with the time it was read.
    for (;;) {
      const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        if (errno == ENOBUFS) {  // the socket overflowed: the kernel dropped messages (their packets
          ++overflows;           // go with the next batch verdict)
          continue;
        }  // the kernel dropped messages: their packets are lost, as on a full queue
        perror("link_delay: recv");
        return 1;
      }
      read_ns = now_ns();
      nfq_handle_packet(h, buf, (int)n);
    }
  }
  release(qh, now_ns(), 1);
  nfq_destroy_queue(qh);
  nfq_close(h);
  printf("link_delay: queue %ld held %llu packets, %.3f ms on average (%llu socket overflows)\n", queue,
         (unsigned long long)total, total ? (double)hold_ns_sum / (double)total / 1e6 : 0.0,
         (unsigned long long)overflows);
  return 0;
}
